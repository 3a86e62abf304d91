"""A mixed step's attention on the GPU: decode rows through the decode kernel (the backend's split) against
every row through the prefill kernel, for the chunked schedule's batch shapes (decodes first, then prompt
chunks), Llama-3.1-8B heads (32 query, 8 KV, dim 128), bf16; and the decode rows through flashinfer's
CUDA-core decode kernel against its tensor-core one (`decode_tensor_cores`), in mixed steps and in pure
decode steps. Times are the 32 layers' attention of one step (CUDA events, median of repeats, plan
included); `rel_diff` is the split's output against the unsplit one's, `tc_rel_diff` the tensor-core
decode's against the CUDA-core one's (all rows: the prompt rows' are equal, so in mixed steps it
understates the decode rows' difference); `tc_kv_gbs` is the KV bytes the decode rows read over the
tensor-core time.

`overlap_ms` runs a mixed step's decode rows (tensor-core kernel) on a second stream beside its prompt chunks'
kernel (`mixed_attention="overlap"`, BULLET_RAY_MIXED_ATTENTION=overlap) against `tc_ms`, the same kernels one
after the other; `overlap_rel_diff` is its output against that one's (the same kernels: 0 up to run-to-run
rounding). `holistic_ms` runs every row of the mixed step in one launch of flashinfer's persistent BatchAttention
(`mixed_attention="holistic"`); `holistic_speedup` is tc_ms over it, `holistic_rel_diff` its output against
`tc_ms`'s (another kernel: bf16 rounding).

    python -m benchmarks.gpu.mixed_attention --out /tmp/out/mixed_attention_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bullet_ray.engine.attention.base import AttentionMetadata
from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend

HEADS, KV_HEADS, DIM, LAYERS, BS = 32, 8, 128, 32, 16
# (decode rows, their context, prompt chunk lengths, each chunk's cached prefix)
SHAPES = [(32, 1024, [2016], 0), (128, 1300, [1920], 0), (256, 1300, [4096], 0), (256, 1300, [1024, 1024], 512),
          (64, 1300, [], 0), (128, 1300, [], 0), (256, 1300, [], 0),
          # the chunked schedule's mixed steps at a 2,048 budget and 64 sequences (kernel_compare_steps_h100):
          # a full chunk, a full chunk after a prefix, short chunks after long prefixes
          (63, 1300, [1985], 0), (63, 1300, [1985], 2048), (63, 1300, [376], 1024), (63, 1300, [127], 4096)]


def metadata(num_decode: int, ctx: int, chunks: list[int], prefix: int, dev: str) -> AttentionMetadata:
    return AttentionMetadata.contiguous([1] * num_decode + chunks, [ctx] * num_decode + [prefix + c for c in chunks],
                                        BS, dev)


def rel_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    """|got - ref| / |ref| (Frobenius norms, in float32)."""
    return float((got.float() - ref.float()).norm() / ref.float().norm())


def step_ms(backend: FlashInferBackend, md: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            split: bool, repeats: int) -> tuple[float, torch.Tensor]:
    times, out = [], q
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        backend.split_mixed_batches = split
        backend.begin_batch(md)
        for layer in range(LAYERS):
            out = backend.forward(layer % backend.kv_cache.shape[0], q, k, v, md)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:]), out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    dev = "cuda"
    rows = []
    for num_decode, ctx, chunks, prefix in SHAPES:
        md = metadata(num_decode, ctx, chunks, prefix, dev)
        num_blocks = sum((n + BS - 1) // BS for n in md.seq_lens_list)
        kv = torch.randn(2, num_blocks, 2, BS, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
        cuda_cores = FlashInferBackend(kv, HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=False,
                                       mixed_attention="split")
        tensor_cores = FlashInferBackend(kv, HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=True,
                                         mixed_attention="split")
        overlapped = FlashInferBackend(kv, HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=True,
                                       mixed_attention="overlap")
        holistic = FlashInferBackend(kv, HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=True,
                                     mixed_attention="holistic")
        t = md.num_tokens
        q = torch.randn(t, HEADS, DIM, device=dev, dtype=torch.bfloat16)
        k = torch.randn(t, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
        v = torch.randn(t, KV_HEADS, DIM, device=dev, dtype=torch.bfloat16)
        row: dict = {"decode_rows": num_decode, "decode_context": ctx, "chunks": chunks, "chunk_prefix": prefix}
        if chunks:
            unsplit_ms, ref = step_ms(cuda_cores, md, q, k, v, False, args.repeats)
            ref = ref.float().clone()
        split_ms, out = step_ms(cuda_cores, md, q, k, v, True, args.repeats)
        out = out.float().clone()
        tc_ms, tc_out = step_ms(tensor_cores, md, q, k, v, True, args.repeats)
        if chunks and num_decode:  # the decode rows on a second stream beside the prompt chunks; every row in one kernel
            for mode, backend in (("overlap", overlapped), ("holistic", holistic)):
                mode_ms, mode_out = step_ms(backend, md, q, k, v, True, args.repeats)
                row.update({f"{mode}_ms": round(mode_ms, 3), f"{mode}_speedup": round(tc_ms / mode_ms, 3),
                            f"{mode}_rel_diff": round(rel_diff(mode_out, tc_out), 6)})
        if chunks:
            row.update(unsplit_ms=round(unsplit_ms, 3), split_ms=round(split_ms, 3),
                       speedup=round(unsplit_ms / split_ms, 2), rel_diff=round(rel_diff(out, ref), 5))
        else:
            row.update(split_ms=round(split_ms, 3))
        kv_bytes = num_decode * ctx * 2 * KV_HEADS * DIM * 2 * LAYERS
        row.update(tc_ms=round(tc_ms, 3), tc_speedup=round(split_ms / tc_ms, 2),
                   tc_rel_diff=round(rel_diff(tc_out, out), 5),
                   tc_kv_gbs=round(kv_bytes / tc_ms / 1e6, 1), cc_kv_gbs=round(kv_bytes / split_ms / 1e6, 1))
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"benchmark": "mixed_attention", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device": torch.cuda.get_device_name(), "command": "python -m benchmarks.gpu.mixed_attention",
              "note": "32 layers' attention of one step, plan included; decodes first, then prompt chunks; "
                      "tc_*: decode rows through the tensor-core decode kernel; overlap_*: those on a second stream beside "
                      "the prompt chunks' kernel; holistic_*: every row in one persistent BatchAttention kernel; *_kv_gbs: the decode rows' KV "
                      "bytes over the step's attention time (prompt chunks included where there are any)",
              "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
