"""Does a GEMM whose grid follows the partition recover the whole GPU's per-SM speed on a green-context partition?

Why (`benchmarks/results/prefill_kernels_h200/`): on a 116-SM partition of the H200, cuBLAS's nvjet kernels for
the qkv / o / down projections of a 2,048-token prefill step run 1.74x slower than on the whole GPU; they launch a
persistent grid of 132 CTAs (the device's SMs) on the partition too, and telling cuBLAS or cuBLASLt the partition's
SM count did not recover the speed. This script times, on the whole GPU and on the prefill stream of each ladder
entry, each projection (`F.linear` shapes, T rows) three ways:
- `cublas`: PyTorch's `F.linear`;
- `triton`: a tiled Triton GEMM (below), one program per output tile: the hardware places the tiles on whatever
  SMs the partition has, so the number of waves follows the partition;
- `triton_persistent`: the same kernel with exactly as many programs as the place has SMs, each looping over tiles
  (what a persistent kernel sized for the partition would do);
each Triton variant at the best of `--configs` (tile shapes), its output checked against `F.linear` (relative
max error). With `--step`, also the whole prefill step per place, plain and
with every projection whose best Triton variant beat cuBLAS routed through it (`triton_projections`), and the two
steps' logits compared. `--green-whole` adds a place on a green context holding every SM: is a partition slow for
its size or for being a green context?

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.partition_gemm --step --out $OUT/partition_gemm.json
    TRITON_INTERPRET=1 python -m benchmarks.gpu.partition_gemm --device cpu     # the kernel's correctness, no GPU

The kernel is `benchmarks/gpu/triton_gemm.py`'s. Measured on the H200 (`benchmarks/results/partition_gemm_h200/`): it
loses to cuBLAS on every projection and place, and a green context holding every SM is as fast as the whole GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import triton

from benchmarks.gpu.triton_gemm import CONFIGS, linear, route_projections
from bullet_ray.engine.lt_gemm import rel_error

CPU_CONFIG = "16x32x16s1w1"
GPU_CONFIGS = [c for c in CONFIGS if c != CPU_CONFIG]


@contextlib.contextmanager
def triton_projections(model: Any, choice: dict[str, tuple[str, int | None]]) -> Any:
    """Inside: every decoder layer's projections named in `choice` ({"qkv": (config name, programs)}) run the
    Triton GEMM (benchmarks/gpu/triton_gemm.route_projections); restored on the way out."""
    undos = []
    try:
        for proj, (config, programs) in choice.items():
            undos.append(route_projections(model, config, (proj,), programs))
        yield
    finally:
        for undo in undos:
            undo()


def cpu_check(seed: int = 0) -> dict[str, Any]:
    """Under TRITON_INTERPRET=1: edge-masked shapes, both launch kinds, against x @ w^T in float32."""
    import torch

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--device cpu runs the kernel in Triton's interpreter: set TRITON_INTERPRET=1")
    torch.manual_seed(seed)
    out = {}
    for m, n, k in ((40, 72, 48), (16, 32, 16), (5, 33, 70)):
        x, w = torch.randn(m, k), torch.randn(n, k)
        ref = x @ w.T
        for label, programs in (("tiles", None), ("persistent3", 3)):
            err = rel_error(linear(x, w, CONFIGS[CPU_CONFIG], programs), ref)
            out[f"{m}x{n}x{k}_{label}"] = err
    # the step path: a tiny model's prefill step with its projections routed through the kernel
    from bullet_ray.perf.sweep import Bench

    bench = Bench("dummy:tiny-llama", "cpu", "float32", use_graphs=False)
    fn = bench.step_fn(bench.batch(1, 24, 0), 0)
    plain = fn()
    with triton_projections(bench.model, {p: (CPU_CONFIG, 2) for p in ("qkv", "o", "gate_up", "down")}):
        routed = fn()
    out["tiny_llama_step_logits"] = rel_error(routed, plain)
    # every nn.Linear has its own forward back (1.0 would count as an error below)
    model: Any = bench.model
    layers: Any = model.model.layers
    out["patches_left"] = float(sum("forward" in mod.__dict__ or "gemm_into" in mod.__dict__
                                    for layer in layers for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                                    layer.mlp.gate_up_proj, layer.mlp.down_proj)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (the interpreter's check)")
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="whose projection shapes")
    parser.add_argument("--decode-sms", default="16,64", help="ladder entries (decode SMs); prefill gets the rest")
    parser.add_argument("--tokens", default="2048,4096", help="rows T of every projection")
    parser.add_argument("--configs", default=",".join(GPU_CONFIGS), help=f"tile configs, of {', '.join(GPU_CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--green-whole", action="store_true",
                        help="also a place 'green<all SMs>': a green context holding every SM (is a partition slow for "
                             "its size or for being a green context?)")
    parser.add_argument("--step", action="store_true",
                        help="also time a whole prefill step (one fresh sequence of T tokens, eager) per place, plain "
                             "and with every projection whose best Triton variant beat cuBLAS routed through it")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "partition_gemm.json")
    args = parser.parse_args(argv)
    if args.device == "cpu":
        errors = cpu_check()
        print(json.dumps(errors, indent=1))
        worst = max(errors.values())
        print(f"worst relative error {worst:.2e}")
        return 0 if worst < 1e-4 else 1
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from benchmarks.gpu.common import on_stream, partition_places
    from benchmarks.gpu.prefill_kernels import projections
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.perf.sweep import _time_s

    cfg = resolve_source(args.model).config
    bench = None
    if args.step:
        from bullet_ray.perf.sweep import Bench

        bench = Bench(args.model, "cuda", "bfloat16", kv_fraction=0.4, use_graphs=False)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    places, close_places = partition_places([int(c) for c in args.decode_sms.split(",") if c], args.green_whole)
    shapes = projections(cfg)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    configs = [c for c in args.configs.split(",") if c]
    results: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    for (label, sms, stream), n_rows in tqdm([(p, t) for p in places for t in tokens], desc="places"):
        for name, (k, n) in shapes.items():
            x = torch.randn(n_rows, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            torch.cuda.synchronize()  # made on the default stream, read on the place's
            flops = 2 * n_rows * k * n

            def timed(fn: Any, stream: Any = stream) -> float:
                return _time_s(*on_stream(fn, stream), args.repeats, 3)

            row: dict[str, Any] = {"place": label, "sms": sms, "tokens": n_rows, "proj": name}
            t = timed(lambda x=x, w=w: F.linear(x, w))
            row["cublas"] = {"ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1)}
            ref = F.linear(x, w)
            for variant, programs in (("triton", None), ("triton_persistent", sms)):
                best: dict[str, Any] | None = None
                for c in configs:
                    def fn(x: Any = x, w: Any = w, c: str = c, programs: int | None = programs) -> Any:
                        return linear(x, w, CONFIGS[c], programs)
                    try:
                        t = timed(fn)
                    except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (shared memory): next one
                        row.setdefault("failed_configs", {})[f"{variant}:{c}"] = str(e)[:200]
                        continue
                    if best is None or t * 1e3 < best["ms"]:
                        run, sync = on_stream(fn, stream)  # the output as the place's stream computes it
                        y = run()
                        sync()
                        best = {"ms": round(t * 1e3, 4), "tflops": round(flops / t / 1e12, 1), "config": c,
                                "rel_err": round(rel_error(y, ref), 5)}
                row[variant] = best  # None: no config ran here (row["failed_configs"] says why)
            ran = [row[v]["ms"] for v in ("triton", "triton_persistent") if row[v] is not None]
            row["best_over_cublas"] = round(row["cublas"]["ms"] / min(ran), 3) if ran else None
            results.append(row)
            print(json.dumps(row), flush=True)
            del x, w, ref
        if bench is not None:
            steps.append(_time_step(bench, [r for r in results if r["place"] == label and r["tokens"] == n_rows],
                                    stream, args.repeats))
            print(json.dumps(steps[-1]), flush=True)
    close_places()
    out = {"benchmark": "partition_gemm", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python -m benchmarks.gpu.partition_gemm " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": {"name": torch.cuda.get_device_name(0), "sms": sm_count, "torch": torch.__version__,
                      "triton": triton.__version__},
           "results": results, "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"\n{'place':12} {'T':>5} {'proj':8} {'cuBLAS':>8} {'triton':>8} {'persist':>8}  TFLOP/s (best config); "
          "best / cuBLAS")
    for r in results:
        tri, per = r["triton"] or {}, r["triton_persistent"] or {}
        ratio = "-" if r["best_over_cublas"] is None else f"{r['best_over_cublas']:.2f}x"
        errs = [v["rel_err"] for v in (tri, per) if v]
        print(f"{r['place']:12} {r['tokens']:>5} {r['proj']:8} {r['cublas']['tflops']:>8} {tri.get('tflops', '-'):>8} "
              f"{per.get('tflops', '-'):>8}  {ratio} ({tri.get('config', '-')}, {per.get('config', '-')}; err "
              f"{max(errs, default=float('nan')):.1e})" + (f"; failed {sorted(r['failed_configs'])}"
                                                           if r.get("failed_configs") else ""))
    for st in steps:
        print(f"step {st['place']:12} T {st['tokens']:>5}: cuBLAS {st['plain_ms']:.2f} ms, with Triton for "
              f"{','.join(st['triton_projs']) or 'none'} {st['triton_ms']:.2f} ms ({st['speedup']:.3f}x; logits rel err "
              f"{st['logits_rel_err']:.1e})")
    print(f"saved {args.out}")
    return 0


def _time_step(bench: Any, rows: list[dict[str, Any]], stream: Any, repeats: int) -> dict[str, Any]:
    """One place's prefill step, plain and with each projection whose best Triton variant beat cuBLAS."""
    from benchmarks.gpu.common import on_stream
    from bullet_ray.perf.sweep import _time_s

    place, sms, n_rows = rows[0]["place"], rows[0]["sms"], rows[0]["tokens"]
    choice = {}
    for r in rows:
        ran = [v for v in ("triton", "triton_persistent") if r[v] is not None]
        if not ran:
            continue
        variant = min(ran, key=lambda v: r[v]["ms"])
        if r[variant]["ms"] < r["cublas"]["ms"]:
            choice[r["proj"]] = (r[variant]["config"], sms if variant == "triton_persistent" else None)
    run, sync = on_stream(bench.step_fn(bench.batch(1, n_rows, 0), 0), stream)
    plain_logits = run()
    plain = _time_s(run, sync, repeats, 2)
    with triton_projections(bench.model, choice):
        tri_logits = run()
        tri = _time_s(run, sync, repeats, 2)
    return {"place": place, "sms": sms, "tokens": n_rows, "plain_ms": round(plain * 1e3, 3),
            "triton_ms": round(tri * 1e3, 3), "speedup": round(plain / tri, 3), "triton_projs": sorted(choice),
            "tokens_per_s": {"plain": round(n_rows / plain), "triton": round(n_rows / tri)},
            "logits_rel_err": rel_error(tri_logits, plain_logits)}


if __name__ == "__main__":
    raise SystemExit(main())
