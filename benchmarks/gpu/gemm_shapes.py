"""Time of a step's GEMMs by token count: does cuBLAS run some row counts slower than a few more rows?

What it is for (issue 13): a mixed step of the chunked schedule multiplies T = prompt tokens + decode rows
rows by every weight; T is whatever the scheduler packed (e.g. 2,048 + 57). cuBLAS picks tiles by shape, so
the time need not grow smoothly with T. This script times the model's four projections (`F.linear`, bf16, the
weights the engine uses: fused qkv, o, fused gate/up, down) for every T of a range and reports, per T, the
step's GEMM time for all layers, its TFLOP/s, and `pad_to`: the T' >= T (up to `--pad-window` more rows) whose
GEMMs run fastest. A T with `pad_gain` > 0 would be faster padded to T' rows (dummy rows); a scheduler could
also round its chunk down to a fast T.

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.gemm_shapes --out $OUT/gemm_shapes
    python -m benchmarks.gpu.gemm_shapes --device cpu --model dummy:tiny-llama --tokens 16:64:16 --reps 2   # smoke

Times are CUDA events around `--reps` back-to-back calls after `--warmup` (each GEMM alone, weights in HBM,
no other stream): kernels as the engine's eager mixed steps launch them, not a whole step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def projections(config: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each GEMM of a decoder layer, as the engine fuses them (the performance model's
    shapes), by the names this script has always written ("qkv", "o", "gate_up", "down")."""
    from bullet_ray.perf.kernels import KernelClass, projection_shapes

    names = {KernelClass.QKV: "qkv", KernelClass.O_PROJ: "o", KernelClass.GATE_UP: "gate_up", KernelClass.DOWN: "down"}
    return {names[cls]: shape for cls, shape in projection_shapes(config).items()}


def parse_range(text: str) -> list[int]:
    """`start:stop:step` (stop included) or a comma-separated list."""
    if ":" in text:
        start, stop, step = (int(x) for x in text.split(":"))
        if start < 1 or step < 1 or stop < start:
            raise SystemExit(f"--tokens: want start:stop:step with 1 <= start <= stop and step >= 1, got {text!r}")
        return list(range(start, stop + 1, step))
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise SystemExit(f"--tokens: want positive counts, got {text!r}")
    return sorted(set(values))


def pad_choices(times: dict[int, float], window: int) -> dict[int, tuple[int, float]]:
    """For each T: the T' in [T, T + window] with the least time, and the fraction of T's time it saves."""
    out = {}
    for t, ms in times.items():
        best = min((u for u in times if t <= u <= t + window), key=lambda u: times[u])
        out[t] = (best, (ms - times[best]) / ms if ms > 0 else 0.0)
    return out


def time_gemms(config: Any, tokens: list[int], device: str, reps: int, warmup: int) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    shapes = projections(config)
    weights = {name: torch.randn(n_out, n_in, dtype=dtype, device=device) * 0.02 for name, (n_in, n_out) in shapes.items()}
    x_max = {name: torch.randn(max(tokens), n_in, dtype=dtype, device=device) for name, (n_in, _) in shapes.items()}
    is_cuda = device.startswith("cuda")
    rows = []
    for t in tqdm(tokens, desc="GEMM shapes", unit="T", file=sys.stderr):
        per: dict[str, float] = {}
        for name, w in weights.items():
            x = x_max[name][:t]
            for _ in range(warmup):
                F.linear(x, w)
            if is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(reps):
                    F.linear(x, w)
                end.record()
                end.synchronize()
                per[name] = start.elapsed_time(end) / reps
            else:
                began = time.perf_counter()
                for _ in range(reps):
                    F.linear(x, w)
                per[name] = (time.perf_counter() - began) * 1e3 / reps
        layer_ms = sum(per.values())
        flops = 2 * t * sum(i * o for i, o in shapes.values())
        rows.append({"tokens": t, "layer_ms": round(layer_ms, 5), "step_ms": round(layer_ms * config.num_hidden_layers, 4),
                     "tflops": round(flops / (layer_ms / 1e3) / 1e12, 1) if layer_ms > 0 else None,
                     "us_per_token": round(layer_ms * config.num_hidden_layers * 1e3 / t, 3),
                     **{f"{name}_ms": round(ms, 5) for name, ms in per.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="a model spec the engine accepts (its shapes)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="1024:4352:32", help="start:stop:step (stop included) or a list")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--pad-window", type=int, default=256, help="rows a T may be padded by (pad_to)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "gemm_shapes")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.warmup < 0 or args.pad_window < 0:
        raise SystemExit("--reps must be >= 1, --warmup and --pad-window >= 0")
    from benchmarks.offline import device_info
    from bullet_ray.models.loader import resolve_source

    config = resolve_source(args.model).config
    tokens = parse_range(args.tokens)
    rows = time_gemms(config, tokens, args.device, args.reps, args.warmup)
    pads = pad_choices({r["tokens"]: r["layer_ms"] for r in rows}, args.pad_window)
    for r in rows:
        r["pad_to"], gain = pads[r["tokens"]]
        r["pad_gain"] = round(gain, 4)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gemm_shapes", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "command": "python -m benchmarks.gpu.gemm_shapes " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": device_info() if args.device.startswith("cuda") else {"name": args.device},
              "model": args.model, "shapes": projections(config), "reps": args.reps, "rows": rows}
    (args.out / "gemm_shapes.json").write_text(json.dumps(result, indent=1))
    gains = sorted(rows, key=lambda r: -r["pad_gain"])[:15]
    print(f"{'T':>6} {'step ms':>9} {'TFLOP/s':>8} {'us/token':>9} {'pad_to':>7} {'gain':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['step_ms']:>9.3f} {r['tflops'] or 0:>8.1f} {r['us_per_token']:>9.3f} "
              f"{r['pad_to']:>7} {r['pad_gain']:>6.1%}")
    print("largest padding gains: " + ", ".join(f"{r['tokens']}->{r['pad_to']} {r['pad_gain']:.1%}" for r in gains))
    print(f"saved {args.out / 'gemm_shapes.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
