"""Replay served steps through the model's online correction: how far each prediction made before a step
was from its measured time, with the shipped profile's calibration and an online correction fed every
earlier step of the log in order (as the workers feed theirs).

Two variants side by side: the correction keyed by step size (the engine's: entry x size bucket, then size
bucket, then phase; bullet_ray/perf/calibration/online.py) and one factor per ladder entry (what the engine
used before; the same class with every step's size set to 1).

    python -m benchmarks.replay_online benchmarks/results/serve_h100_m2c/bullet-slo-steps.jsonl.gz \
        benchmarks/results/serve_h100_code/bullet-slo-steps.jsonl.gz --out benchmarks/results/replay_online_h100.json
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.refit_from_steps import PROFILE, sample_of, step_rows
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.loader import preset_hf_config
from bullet_ray.perf.calibration import OnlineCorrection
from bullet_ray.perf.model import PerfModel, quantile
from bullet_ray.perf.profile import load_profile

WARMUP_STEPS = 5  # the first steps of a log include CUDA/JIT warm-up


def replay(model: PerfModel, path: Path, by_size: bool, weight: float) -> dict[str, Any]:
    """Relative errors |predicted - measured| / measured per phase, each step predicted before it is observed."""
    online = OnlineCorrection(weight=weight)
    errors: dict[str, list[float]] = {"prefill": [], "decode": []}
    for i, row in enumerate(step_rows(path)):  # one read of the log
        sample = sample_of(row)
        shape = sample.shape
        base = model.predict(shape, sample.sms, sample.other_busy).calibrated_s
        size = shape.size if by_size else 1
        predicted = base * online.factor(shape.phase, row["split_index"], size)
        if i >= WARMUP_STEPS:
            errors[shape.phase].append(abs(predicted - sample.measured_s) / sample.measured_s)
        online.observe(shape.phase, row["split_index"], base, sample.measured_s, size)
    return {p: {"steps": len(e), "median": round(quantile(e, 0.5), 4), "p90": round(quantile(e, 0.9), 4)}
            for p, e in errors.items() if e}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", type=Path, nargs="+", help="step logs (step_log_path JSONL, .gz ok)")
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--preset", default="llama-3.1-8b", help="the model's dummy preset (its config)")
    parser.add_argument("--weight", type=float, default=OnlineCorrection().weight, help="the averages' weight")
    parser.add_argument("--out", type=Path, default=None, help="JSON result")
    args = parser.parse_args(argv)
    for path in args.logs:
        if not path.exists():
            parser.error(f"logs: {path} does not exist")
    model = PerfModel.from_profile(load_profile(args.profile), ModelConfig.from_hf_dict(preset_hf_config(args.preset)))
    result: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": "python -m benchmarks.replay_online " + " ".join(sys.argv[1:] if argv is None else argv),
        "profile": args.profile.name, "weight": args.weight, "logs": {}}
    for path in args.logs:
        result["logs"][str(path)] = {"by_size": replay(model, path, True, args.weight),
                                     "per_entry": replay(model, path, False, args.weight)}
        for variant, phases in result["logs"][str(path)].items():
            text = ", ".join(f"{p} median {v['median']:.1%} p90 {v['p90']:.1%} ({v['steps']} steps)"
                             for p, v in phases.items())
            print(f"{path.parent.name}/{path.name} [{variant}]: {text}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
