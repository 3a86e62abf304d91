"""Get `.carry/` ready for a GPU lease and print the stage calls that carry it, each under a call's 64 MiB.

A device call carries the working tree plus the ignored paths it names (at most 8, 64 MiB in all), so the parts a
serving lease needs (`../shared/gpu/fetch_wheels.sh`'s wheel folders, the Azure traces, the tuned cuBLASLt
choices, a flashinfer JIT cache, the embedded SmolLM2 for real-weights checks) go to the machine in several
`run_serve_h100.sh stage` calls, back to back (the machine keeps /tmp only while it stays warm, ~30 s idle).
This makes the small parts, then packs every `.carry/<part>` folder into as few calls as fit beside the tree:

    python -m benchmarks.gpu.prepare_lease                # wheels must exist: ../shared/gpu/fetch_wheels.sh ray flashinfer vllm
    python -m benchmarks.gpu.prepare_lease --no-vllm --smollm2 --jit /path/fi_jit_cache.tgz

The tree's size counts every tracked file; `benchmarks/results/` (~230 MB) must be moved out first (the lease's
procedure in docs/gpu.md), which this checks. Nothing is sent anywhere: it prints the calls, one `carry` list each.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.resplit_carry import CALL_LIMIT, FOLDER_MARGIN, tracked_bytes

MIB = 1 << 20
MAX_PATHS = 8  # carry paths per call
# the tuned cuBLASLt choices of the H200 lease m5, under benchmarks/results/ or where the lease's procedure moves it
LT_CACHE = Path("serve_h200_m5/lt_gemm_cache_h200.json")
RESULTS_DIRS = (Path("benchmarks/results"), Path("../results_stash"))
TRACES = Path("../shared/data/azure-llm-inference-2023")


def folder_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def pack(parts: dict[str, int], budget: int, max_paths: int = MAX_PATHS) -> list[list[str]]:
    """Parts (name -> bytes) into as few calls as first-fit decreasing finds, each call's parts summing to at most
    `budget` bytes and numbering at most `max_paths`. A part larger than the budget is refused (ValueError): a wheel
    part must be cut first (`benchmarks.gpu.resplit_carry`, whose default folder size is this budget)."""
    too_big = [name for name, size in parts.items() if size > budget]
    if too_big:
        raise ValueError(f"{', '.join(sorted(too_big))}: larger than one call's room ({budget / 1e6:.1f} MB beside "
                         f"the tree); repack wheel parts with python -m benchmarks.gpu.resplit_carry --max-mb "
                         f"{budget / 1e6:.1f}, leave a JIT cache that large out")
    calls: list[list[str]] = []
    for name in sorted(parts, key=lambda n: (-parts[n], n)):
        room = next((c for c in calls if sum(parts[n] for n in c) + parts[name] <= budget and len(c) < max_paths), None)
        if room is None:
            calls.append([name])
        else:
            room.append(name)
    return [sorted(names) for names in calls]


def make_small_parts(root: Path, smollm2: bool, jit: Path | None) -> None:
    """The traces, the cuBLASLt choices, the JIT cache and (with `smollm2`) the SmolLM2 parts, where their sources
    exist (copied as plain files: the shared traces are read-only)."""
    carry = root / ".carry"
    traces = root / TRACES
    if traces.is_dir():
        (carry / "azure").mkdir(parents=True, exist_ok=True)
        for f in traces.glob("*.csv"):
            shutil.copyfile(f, carry / "azure" / f.name)
    lt_cache = next((root / d / LT_CACHE for d in RESULTS_DIRS if (root / d / LT_CACHE).is_file()), None)
    if lt_cache is not None:
        (carry / "lt-cache").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(lt_cache, carry / "lt-cache" / "lt_gemm.json")
    elif not (carry / "lt-cache" / "lt_gemm.json").is_file():  # the results were moved elsewhere: say so, not skip
        print(f"prepare_lease: no {LT_CACHE} under {' or '.join(map(str, RESULTS_DIRS))}: the lease re-times "
              "cuBLASLt's choices at start (~40 s per worker)", file=sys.stderr)
    if jit is not None:
        (carry / "fi-jit").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(jit, carry / "fi-jit" / "fi_jit_cache.tgz")
    if smollm2:
        subprocess.run(["bash", "benchmarks/gpu/carry_smollm2.sh"], cwd=root, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-vllm", action="store_true", help="leave the .carry/vllm-* parts out (a lease of "
                        "bullet and chunked only)")
    parser.add_argument("--smollm2", action="store_true", help="also pack the embedded SmolLM2 (carry_smollm2.sh)")
    parser.add_argument("--jit", type=Path, help="a flashinfer JIT cache from an earlier call's $OUT/fi_jit_cache.tgz")
    args = parser.parse_args(argv)
    root = Path.cwd()
    if args.jit is not None and not args.jit.is_file():
        parser.error(f"--jit: {args.jit} is not a file")
    if not (root / ".carry").is_dir() or not any((root / ".carry").glob("flashinfer-*")):
        print("prepare_lease: no .carry/flashinfer-*: run ../shared/gpu/fetch_wheels.sh ray flashinfer vllm first",
              file=sys.stderr)
        return 2
    if (root / "benchmarks" / "results").is_dir():
        print("prepare_lease: benchmarks/results/ is in the tree (~230 MB; a call carries 64 MiB): move it out for the "
              "lease, e.g. mv benchmarks/results ../results_stash, and back afterwards", file=sys.stderr)
        return 2
    make_small_parts(root, args.smollm2, args.jit)
    left_out = ("vllm-",) * args.no_vllm + ("smol-",) * (not args.smollm2)
    parts = {p.name: folder_size(p) for p in sorted((root / ".carry").iterdir())
             if p.is_dir() and not p.name.startswith(left_out)}
    tree = tracked_bytes(root)
    budget = CALL_LIMIT - tree - FOLDER_MARGIN
    try:
        calls = pack(parts, budget)
    except ValueError as e:
        print(f"prepare_lease: {e}", file=sys.stderr)
        return 2
    print(f"tree {tree / 1e6:.1f} MB; {len(parts)} parts, {sum(parts.values()) / 1e6:.0f} MB, in {len(calls)} stage "
          f"calls of at most {budget / 1e6:.1f} MB each (issue them back to back: "
          "`bash benchmarks/gpu/run_serve_h100.sh stage`, kind nvidia-h200):")
    for i, names in enumerate(calls, 1):
        print(f"{i:3d}: carry {[f'.carry/{n}' for n in names]}  ({sum(parts[n] for n in names) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
