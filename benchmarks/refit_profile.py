"""Refit a saved `bullet-ray profile` from its own samples (`--add`: and another sweep's, e.g. the ladder entries
the first did not reach): the bandwidth curve's shape from the decode steps
(`bullet_ray.perf.model.refine_bandwidth_curve`), then the calibration; prints each phase's error before and
after (alone / other side busy) and writes the refitted profile. No GPU needed.

    python -m benchmarks.refit_profile benchmarks/results/lease_m2l/profile_sweep_h100.json \
        --out bullet_ray/perf/profiles/
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from bullet_ray.perf.model import PerfModel, errors_by_side, profile_fit, refine_bandwidth_curve
from bullet_ray.perf.profile import load_profile, save_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="a profile JSON written by bullet-ray profile")
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="the profile's model (its config)")
    parser.add_argument("--out", type=Path, required=True, help="folder (or file) for the refitted profile")
    parser.add_argument("--add", type=Path, action="append", default=[],
                        help="another sweep of the same GPU, model and dtype (e.g. the ladder entries the first did "
                             "not reach): its samples join the refit; repeatable")
    args = parser.parse_args(argv)
    from bullet_ray.models.loader import resolve_source

    if not args.profile.is_file():
        print(f"error: profile: {args.profile} is not a file", file=sys.stderr)
        return 2
    cfg = resolve_source(args.model).config
    old = load_profile(args.profile)
    if not old.samples:
        print(f"error: profile: {args.profile} holds no samples to refit from", file=sys.stderr)
        return 2
    samples = list(old.samples)
    for extra in args.add:
        if not extra.is_file():
            print(f"error: --add: {extra} is not a file", file=sys.stderr)
            return 2
        other = load_profile(extra)
        if (other.gpu.name, other.model, other.dtype) != (old.gpu.name, old.model, old.dtype):
            print(f"error: --add: {extra} profiles {other.gpu.name} / {other.model.get('name')} / {other.dtype}, not "
                  f"{old.gpu.name} / {old.model.get('name')} / {old.dtype}", file=sys.stderr)
            return 2
        samples += other.samples
    old = dataclasses.replace(old, samples=samples)
    gpu, calibration = refine_bandwidth_curve(cfg, old.gpu, old.samples)
    added = f" and {', '.join(str(a.name) for a in args.add)}" if args.add else ""
    new = dataclasses.replace(old, gpu=gpu, calibration=calibration, notes=(
        f"{old.notes}\nRefitted from its own samples{added} by `python -m benchmarks.refit_profile`: bandwidth curve "
        f"saturation_sms {old.gpu.saturation_sms} -> {gpu.saturation_sms}, knee {old.gpu.knee} -> {gpu.knee} "
        "(refine_bandwidth_curve), then the calibration."))
    model = PerfModel.from_profile(new, cfg)
    new = dataclasses.replace(new, fit=profile_fit(model, samples))  # a new record: the sample count changes with --add
    report = {"before": errors_by_side(PerfModel.from_profile(old, cfg), samples), "after": errors_by_side(model, samples),
              "curve": {"before": [old.gpu.saturation_sms, old.gpu.knee], "after": [gpu.saturation_sms, gpu.knee]}}
    for key in report["before"]:
        b, a = report["before"][key], report["after"][key]
        print(f"{key:16s} median {b['median']:.3f} -> {a['median']:.3f}   p90 {b['p90']:.3f} -> {a['p90']:.3f}   (n={a['n']})")
    print(f"bandwidth curve (saturation_sms, knee): {report['curve']['before']} -> {report['curve']['after']}")
    print(json.dumps({"calibration": calibration.to_dict()}))
    print(f"wrote {save_profile(new, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
