"""Does the tensor-core decode kernel's split-KV plan make CUDA-graph and eager decode differ, and what does
planning without a split cost?

flashinfer 0.7.2 plans the tensor-core decode kernel (the prefill kernel for one-token rows) with split-KV
always on in CUDA-graph mode, its chunk size from the padded grid, and eagerly from the real lengths; a long
row's partial results then merge in another order. With BULLET_RAY_DECODE_SPLIT_KV=0 every decode plan, eager
and in graphs, passes `disable_split_kv`. For both settings this runs the chunked schedule's greedy tokens with
decode graphs vs eager (`step_checks.chunked_graphs_vs_eager`, as engine_speed does) and times decode graph
steps at batch 1 / 16 / 64 / 256 x 1k / 4k context (`engine_speed.decode_with_graphs`).

    python -m benchmarks.gpu.decode_split_check          # $OUT/decode_split_check_h100.json
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from benchmarks.gpu.common import copy_bandwidth_gbs, save
from benchmarks.gpu.engine_common import make_runner
from benchmarks.gpu.engine_speed import BLOCK, decode_with_graphs
from benchmarks.gpu.step_checks import chunked_graphs_vs_eager
from bullet_ray.models.loader import load_model

# enough KV for batch 64 x 4k and 256 x 1k (engine_speed's largest graph cases)
NUM_BLOCKS = 17_000


@torch.inference_mode()
def main() -> int:
    bw = copy_bandwidth_gbs()
    loaded = load_model("dummy:llama-3.1-8b", dtype=torch.bfloat16, device="cuda", show_progress=False)
    model, cfg = loaded.model, loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = cfg.kv_bytes_per_token(2)
    out: dict = {"copy_bandwidth_gbs": round(bw)}
    for split in ("1", "0"):
        os.environ["BULLET_RAY_DECODE_SPLIT_KV"] = split  # read by every backend built from here on
        agree = chunked_graphs_vs_eager(model, cfg)
        print(f"split_kv={split}: graph vs eager tokens equal {agree['tokens_equal']}, "
              f"agreement {agree['token_agreement']}, rows {agree['rows_equal']}", flush=True)
        runner, kv = make_runner(model, cfg, "flashinfer", NUM_BLOCKS, BLOCK, "cuda", torch.bfloat16)
        kv.normal_()
        timing = decode_with_graphs(runner, cfg, NUM_BLOCKS, NUM_BLOCKS * BLOCK, weight_bytes, kv_per_token, bw)
        out[f"split_kv_{split}"] = {"chunked_graphs_vs_eager": agree, "decode_cuda_graphs": timing}
        del runner, kv
        gc.collect()
        torch.cuda.empty_cache()
    for key, row in out["split_kv_1"]["decode_cuda_graphs"].items():
        other = out["split_kv_0"]["decode_cuda_graphs"].get(key)
        if isinstance(row, dict) and isinstance(other, dict):
            print(f"{key:>14}: split {row['ms']:7.3f} ms (back to back {row['pipelined_ms']:7.3f}), "
                  f"no split {other['ms']:7.3f} ms ({other['pipelined_ms']:7.3f})")
    save("decode_split_check_h100", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
