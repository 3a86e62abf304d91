"""`bullet-ray profile` on the GPU in one device call, and how the measured profile compares with the seed: the shipped
profile of the same device (the H200's is derived from the H100's), else the H100's.

Run on the GPU machine after flashinfer is installed (the engine scripts' staging), from the repo root:

    STEPS=warm_jit bash benchmarks/gpu/run_engine_h100.sh && \\
    PYTHONPATH=/tmp/site:$PWD FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws python3 -m benchmarks.gpu.profile_h100

It sweeps ladder entries ENTRIES in that order (default 6,0,12,3,9: 64/16/112/40/88 decode SMs; the entries
with few prefill SMs take longest) while MAX_SECONDS (default 420) allows, and writes
$OUT/<gpu>__llama-3-1-8b__bfloat16.json plus a comparison with the seed: each
measured step's error under the shipped calibration and under the new fit. On 2026-11-26 the whole ladder in
the order 6,0,12,3,9,1,11,4,8,2,10,5,7 reached 11 entries in MAX_SECONDS=470 (726 steps; the progress bar read 6:37):
benchmarks/results/lease_m2l/. Copy the new file over bullet_ray/perf/profiles/ to ship it (the sweep already
picks the bandwidth curve from its decode steps; `python -m benchmarks.refit_profile` does it to an older file).
The prefill side's GEMMs are the engine's default (`--prefill-gemm auto`: cuBLASLt tuned per partition, ~38 s at the
start, before MAX_SECONDS' clock, unless `~/.cache/bullet_ray/lt_gemm.json` holds the choices); PREFILL_GEMM=cublas
profiles PyTorch's cuBLAS instead.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from bullet_ray.perf import profile_cli
from bullet_ray.perf.model import PerfModel, errors_by_side
from bullet_ray.perf.profile import PACKAGE_DIR, load_profile


def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    profile_cli.add_parser(sub)
    args = parser.parse_args(["profile", "--model", "dummy:llama-3.1-8b", "--device", "cuda", "--out", str(out),
                              "--entries", os.environ.get("ENTRIES", "6,0,12,3,9"),
                              "--max-seconds", os.environ.get("MAX_SECONDS", "420"),
                              "--prefill-gemm", os.environ.get("PREFILL_GEMM", "auto"),
                              *(["--quick"] if os.environ.get("QUICK") == "1" else [])])
    rc = profile_cli.run(args)
    if rc:
        return rc
    new_path = next(out.glob("*__llama-3-1-8b__bfloat16.json"))
    new = load_profile(new_path)
    from bullet_ray.models.loader import resolve_source

    cfg = resolve_source("dummy:llama-3.1-8b").config
    report = {}
    # the shipped profile of this device (on an H200 the derived one: docs/policy.md section 2), else the H100's
    shipped = PACKAGE_DIR / new_path.name
    if not shipped.is_file():
        shipped = PACKAGE_DIR / "nvidia-h100-80gb-hbm3__llama-3-1-8b__bfloat16.json"
    report["seed_file"] = {"name": shipped.name, "source": load_profile(shipped).source}
    print(f"seed: {shipped.name} ({report['seed_file']['source']})")
    for label, path in (("seed", shipped), ("measured", new_path)):
        model = PerfModel.from_profile(load_profile(path), cfg)
        report.update({f"{label}.{key}": v for key, v in errors_by_side(model, new.samples).items()})
    (out / "profile_h100_report.json").write_text(json.dumps(report, indent=1))
    for k, v in report.items():
        if k != "seed_file":
            print(f"{k:32s} median {v['median']:.3f}  p90 {v['p90']:.3f}  (n={v['n']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
