"""Refit a profile's calibration from the steps a serving run measured (a `step_log_path` JSONL), and say
how well the old and the new factors predict held-out steps.

The rows carry each bullet-side step's shape, the SMs it ran on, whether the other side was busy, and its
device time (CUDA events). Rows written before the logs recorded `num_attention_pairs` get it estimated
from equal-length sequences (q new tokens over c context tokens per sequence: q (c - q) + q (q + 1) / 2).
The base model is judged without the engine's online correction.

    python -m benchmarks.refit_from_steps --fit serve_h100_m2b/bullet-slo-steps.jsonl.gz \
        --check serve_h100_code/bullet-slo-steps.jsonl.gz [--write]     # --write: into the shipped profile
    python -m benchmarks.refit_from_steps --fit serve_h200_m2z/bullet-slo+direct-steps.jsonl.gz --halves \
        --profile bullet_ray/perf/profiles/nvidia-h200__llama-3-1-8b__bfloat16.json

A serving log runs prefill alone mostly for each rate's first requests (a few shapes): where a phase ran alone in
fewer than --min-alone-shapes shapes (default bullet_ray.perf.calibration.fit.SERVED_MIN_ALONE_SHAPES; 0: off) the
fit keeps the profile's base factors and fits the co-run slowdown only; the output's "alone_shapes" says how many
each phase had.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.plot_steps import records
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.loader import preset_hf_config
from bullet_ray.perf.calibration.fit import SERVED_MIN_ALONE_SHAPES, num_shapes
from bullet_ray.perf.model import PerfModel, quantile, relative_errors
from bullet_ray.perf.profile import Profile, Sample, load_profile, save_profile

PROFILE = Path(__file__).resolve().parents[1] / "bullet_ray" / "perf" / "profiles" / \
    "nvidia-h100-80gb-hbm3__llama-3-1-8b__bfloat16.json"


def _pairs(row: dict[str, Any]) -> int:
    if "num_attention_pairs" in row:
        return int(row["num_attention_pairs"])
    s = max(1, row["num_seqs"])
    q, c = row["num_tokens"] / s, row["num_context_tokens"] / s
    return max(1, int(s * (q * (c - q) + q * (q + 1) / 2)))


def step_rows(path: Path) -> list[dict[str, Any]]:
    """The log's measured steps of the bullet sides (prefill, decode)."""
    return [row for row in records(str(path)) if row.get("kind") == "step"
            and row.get("side") in ("prefill", "decode") and row["measured_ms"] > 0]


def sample_of(row: dict[str, Any]) -> Sample:
    sms = row["prefill_sms"] if row["side"] == "prefill" else row["decode_sms"]
    return Sample(row["phase"], row["num_tokens"], row["num_seqs"], row["num_context_tokens"],
                  _pairs(row), int(sms), bool(row["other_busy"]), row["measured_ms"] / 1e3)


def samples_of(path: Path) -> list[Sample]:
    return [sample_of(row) for row in step_rows(path)]


def report(model: PerfModel, samples: list[Sample]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase in ("prefill", "decode"):
        errs = relative_errors(model, [s for s in samples if s.phase == phase])
        out[phase] = {"steps": len(errs), "median": round(quantile(errs, 0.5), 4) if errs else None,
                      "p90": round(quantile(errs, 0.9), 4) if errs else None}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", type=Path, nargs="+", required=True, help="step logs to fit on")
    parser.add_argument("--check", type=Path, nargs="*", default=[], help="held-out step logs")
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--preset", default="llama-3.1-8b", help="the model's dummy preset (its config)")
    parser.add_argument("--min-alone-shapes", type=int, default=SERVED_MIN_ALONE_SHAPES,
                        help="a phase that ran alone in fewer shapes keeps the profile's base factors (0: off)")
    parser.add_argument("--without-profile-samples", action="store_true",
                        help="fit on the logs' steps alone, not with the profile's own samples")
    parser.add_argument("--halves", action="store_true",
                        help="fit on the first half of the --fit logs' steps (in log order), check on the second")
    parser.add_argument("--write", action="store_true", help="store the refit factors in --profile")
    args = parser.parse_args(argv)
    profile = load_profile(args.profile)
    cfg = ModelConfig.from_hf_dict(preset_hf_config(args.preset))
    base = PerfModel.from_profile(profile, cfg)
    fit_samples = [s for p in args.fit for s in samples_of(p)]
    check_samples = [s for p in args.check for s in samples_of(p)]
    if args.halves:
        half = len(fit_samples) // 2
        fit_samples, check_samples = fit_samples[:half], fit_samples[half:] + check_samples
    samples = fit_samples + ([] if args.without_profile_samples else profile.samples)
    refit = PerfModel(cfg, profile.gpu, base.fit(samples, min_alone_shapes=args.min_alone_shapes), base.dtype_bytes)
    alone_shapes = {phase: num_shapes(base.observation(x) for x in samples if x.phase == phase and not x.other_busy)
                    for phase in ("prefill", "decode")}
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m benchmarks.refit_from_steps " + " ".join(sys.argv[1:] if argv is None else argv),
              "profile": str(args.profile.name), "fit_steps": len(fit_samples), "check_steps": len(check_samples),
              "profile_samples": 0 if args.without_profile_samples else len(profile.samples),
              "alone_shapes": alone_shapes, "min_alone_shapes": args.min_alone_shapes,
              "old": {"calibration": profile.calibration.to_dict(), "fit_logs": report(base, fit_samples),
                      "check_logs": report(base, check_samples)},
              "new": {"calibration": refit.calibration.to_dict(), "fit_logs": report(refit, fit_samples),
                      "check_logs": report(refit, check_samples)}}
    print(json.dumps(result, indent=1))
    if args.write:
        note = (f"\n\nRefit {result['date']} from {len(fit_samples)} served steps (device time, CUDA events): "
                + ", ".join(str(p) for p in args.fit) + f" (`{result['command']}`).")
        updated = Profile(profile.gpu, profile.model, profile.dtype, profile.ladder, refit.calibration,
                          profile.samples, profile.date, profile.command, profile.source, profile.notes + note,
                          {**profile.fit, "refit_from_steps": {k: result[k] for k in ("date", "fit_steps", "check_steps")}
                           | {"new": {"fit_logs": result["new"]["fit_logs"], "check_logs": result["new"]["check_logs"]}}})
        save_profile(updated, args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
