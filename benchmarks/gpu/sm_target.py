"""Prefill and decode steps on a green-context partition with cuBLAS told (or not) how many SMs it has.

Why: the shipped H100 profile shows a prefill step on a partition far slower than its share of the GPU
(2,048 tokens: 31.0k tokens/s on 116 of 132 SMs, 29.3k on 92, 28.8k on 84, against ~40k on the whole GPU,
alone, with the other side idle), and nearly flat from 84 to 116 SMs. cuBLAS sizes its grids (persistent
kernels launch one CTA per SM) for the device's 132 SMs; on 116 the last CTAs run as a second, nearly empty
wave. cuBLASLt takes a target SM count (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), which PyTorch sets from
`torch._C._set_sm_carveout_experimental(n)` (target = device SMs - n) when matmuls go through cuBLASLt
(`torch.backends.cuda.preferred_blas_library("cublaslt")`).

What it times, each on the prefill streams of the given ladder entries (and the whole GPU), in three modes:
`cublas` (PyTorch's default), `cublaslt` (no target), `cublaslt+target` (target = the partition's SMs):
the step as the engine runs it (build_metadata, eager forward, lm_head: `Bench.step_fn`) for prefill batches
of 1,024 / 2,048 / 4,096 / 8,192 tokens, and with `--decode` eager decode steps on the decode streams.
Median of `--repeats` after warm-up; tokens/s and the ratio to `cublas` per point, in one JSON.

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.sm_target --out $OUT/sm_target.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

MODES = ("cublas", "cublaslt", "cublaslt+target")


def set_mode(torch: Any, mode: str, sm_count: int, sms: int) -> None:
    """PyTorch's BLAS library and SM carveout for `mode` on a partition of `sms` of `sm_count` SMs."""
    torch.backends.cuda.preferred_blas_library("cublas" if mode == "cublas" else "cublaslt")
    carve = sm_count - sms if mode == "cublaslt+target" and sms < sm_count else None
    torch._C._set_sm_carveout_experimental(carve)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--decode-sms", default="16,32,48,64", help="ladder entries (decode SMs); prefill gets the rest")
    parser.add_argument("--tokens", default="1024,2048,4096,8192", help="prefill batch sizes (one sequence each)")
    parser.add_argument("--decode", default="32x1024,128x1024", help="decode batches (seqs x context); empty: none")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "sm_target.json")
    args = parser.parse_args(argv)

    import torch
    from tqdm import tqdm

    from benchmarks.gpu.common import on_stream
    from bullet_ray.gpu.partition import make_partitioner
    from bullet_ray.perf.sweep import Bench, _time_s

    bench = Bench(args.model, "cuda", "bfloat16", kv_fraction=0.5, use_graphs=False)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    counts = [int(x) for x in args.decode_sms.split(",") if x]
    partitioner = make_partitioner("green", "both", 0, counts)
    tokens = [int(x) for x in args.tokens.split(",") if x]
    decodes = [tuple(int(v) for v in d.split("x")) for d in args.decode.split(",") if d]
    # (label, side, sms, stream): the whole GPU first, then each entry's prefill (and decode) stream
    places: list[tuple[str, str, int, Any]] = [("whole", "prefill", sm_count, None)]
    for e in partitioner.ladder:
        places.append((f"entry{e.index}", "prefill", e.prefill_sms, partitioner.stream(e.index, "prefill")))
        if decodes:
            places.append((f"entry{e.index}", "decode", e.decode_sms, partitioner.stream(e.index, "decode")))
    points = []
    for label, side, sms, stream in places:
        batches = [(f"prefill{n}", n, bench.batch(1, n, 0)) for n in tokens] if side == "prefill" else \
            [(f"decode{b}x{c}", b, bench.batch(b, 1, c - 1)) for b, c in decodes]
        for name, n, batch in batches:
            points.append((label, side, sms, stream, name, n, batch))
    results = []
    for label, side, sms, stream, name, n, batch in tqdm(points, desc="points"):
        fn = bench.step_fn(batch, 0)
        row: dict[str, Any] = {"place": label, "side": side, "sms": sms, "step": name, "tokens": n}
        run, sync = on_stream(fn, stream)
        for mode in MODES:
            set_mode(torch, mode, sm_count, sms)
            t = _time_s(run, sync, args.repeats, 2)
            row[mode] = {"ms": round(t * 1e3, 3), "tokens_per_s": round(n / t)}
        base = row["cublas"]["ms"]
        row["speedup"] = {m: round(base / row[m]["ms"], 3) for m in MODES[1:]}
        results.append(row)
        print(json.dumps(row), flush=True)
    set_mode(torch, "cublas", sm_count, sm_count)
    out = {"benchmark": "sm_target", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python -m benchmarks.gpu.sm_target " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": {"name": torch.cuda.get_device_name(0), "sms": sm_count, "torch": torch.__version__},
           "ladder": [{"decode_sms": e.decode_sms, "prefill_sms": e.prefill_sms} for e in partitioner.ladder],
           "modes": MODES, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{'place':8} {'side':7} {'SMs':>4} {'step':16} " + " ".join(f"{m:>16}" for m in MODES))
    for r in results:
        print(f"{r['place']:8} {r['side']:7} {r['sms']:>4} {r['step']:16} "
              + " ".join(f"{r[m]['ms']:>9.2f} ms" + (f" {r['speedup'].get(m, 1):4.2f}x" if m != 'cublas' else "      ")
                         for m in MODES))
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
