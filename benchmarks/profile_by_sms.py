"""A saved profile read by SM count: how fast its fresh prefill steps ran on each partition (alone and beside a
busy decode side), how far the static performance model (no online correction) misses them per SM count, and,
with --compute-curve, the model's errors if its compute ceiling saturated in SMs the way its bandwidth curve does
(calibration refitted, bandwidth curve refined after it; a trial, not a change to the model). No GPU needed.

    python -m benchmarks.profile_by_sms --compute-curve 200,1 --compute-curve 100,2 \
        > benchmarks/results/profile_by_sms_h100/profile_by_sms.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from bullet_ray.perf.model import PerfModel, quantile, refine_bandwidth_curve, relative_errors
from bullet_ray.perf.profile import Profile, Sample, load_profile
from bullet_ray.perf.roofline import GpuSpec

SHIPPED = Path(__file__).resolve().parents[1] / "bullet_ray" / "perf" / "profiles" / \
    "nvidia-h100-80gb-hbm3__llama-3-1-8b__bfloat16.json"


@dataclass(frozen=True)
class SaturatingCompute(GpuSpec):
    """A GPU whose compute ceiling bends like its bandwidth curve (x / (1 + x^knee)^(1/knee), x = SMs / saturation),
    the whole device still at peak_tflops."""

    compute_saturation_sms: float = 200.0
    compute_knee: float = 1.0

    def _h(self, sms: float) -> float:
        x = sms / self.compute_saturation_sms
        return x / (1.0 + x ** self.compute_knee) ** (1.0 / self.compute_knee)

    def compute_flops_per_s(self, sms: float) -> float:
        n = min(max(sms, 1e-9), self.sm_count)
        return self.peak_tflops * 1e12 * self._h(n) / self._h(self.sm_count)


def fresh_prefill_rates(samples: list[Sample]) -> dict[tuple[int, int], dict[bool, float]]:
    """(prompt tokens of the step, SMs) -> {other side busy: tokens / s} of prefill steps with nothing cached."""
    out: dict[tuple[int, int], dict[bool, float]] = defaultdict(dict)
    for s in samples:
        if s.phase == "prefill" and s.shape.num_context_tokens == s.shape.num_tokens:
            out[(s.shape.num_tokens, s.sms)][s.other_busy] = s.shape.num_tokens / s.measured_s
    return out


def signed_errors_by_sms(model: PerfModel, samples: list[Sample], min_tokens: int) -> dict[int, float]:
    """SMs -> median (predicted - measured) / measured of the prefill steps of >= `min_tokens` tokens."""
    by_sms: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        if s.phase == "prefill" and s.shape.num_tokens >= min_tokens:
            by_sms[s.sms].append(model.predict(s.shape, s.sms, s.other_busy).calibrated_s / s.measured_s - 1)
    return {sms: statistics.median(v) for sms, v in sorted(by_sms.items())}


def errors(model: PerfModel, samples: list[Sample]) -> str:
    parts = []
    for phase in ("prefill", "decode"):
        e = relative_errors(model, [s for s in samples if s.phase == phase])
        parts.append(f"{phase} {quantile(e, 0.5):.1%} / {quantile(e, 0.9):.1%}")
    return ", ".join(parts)


def report(profile: Profile, model: PerfModel, curves: list[tuple[float, float]], min_tokens: int) -> None:
    samples = list(profile.samples)
    print(f"profile: {profile.gpu.name}, {profile.model.get('name')}, {profile.dtype} ({profile.date}; "
          f"{len(samples)} samples)\n")
    print("fresh prefill steps, tokens/s (alone / decode side busy):\n")
    print("| step tokens | SMs | alone | busy |\n|---|---|---|---|")
    for (tokens, sms), row in sorted(fresh_prefill_rates(samples).items()):
        cells = [f"{row[b]:,.0f}" if b in row else "-" for b in (False, True)]
        print(f"| {tokens} | {sms} | {cells[0]} | {cells[1]} |")
    print(f"\nstatic model (no online correction), prefill steps of >= {min_tokens} tokens, median "
          "(predicted - measured) / measured by SMs (negative: predicted too fast):\n")
    print("| SMs | error |\n|---|---|")
    for sms, err in signed_errors_by_sms(model, samples, min_tokens).items():
        print(f"| {sms} | {err:+.1%} |")
    print(f"\n|predicted - measured| / measured, median / p90: shipped model: {errors(model, samples)}")
    for sat, knee in curves:
        spec = SaturatingCompute(**profile.gpu.to_dict(), compute_saturation_sms=sat, compute_knee=knee)
        trial = PerfModel(model.cfg, spec, dtype_bytes=model.dtype_bytes)
        trial.calibration = trial.fit(samples)
        print(f"compute curve saturation {sat:g} SMs, knee {knee:g}, calibration refitted: {errors(trial, samples)}")
        gpu, calibration = refine_bandwidth_curve(model.cfg, spec, samples, model.dtype_bytes)
        refined = PerfModel(model.cfg, gpu, calibration, model.dtype_bytes)
        print(f"  and the bandwidth curve refined after it (saturation {gpu.saturation_sms:g}, knee {gpu.knee:g}): "
              f"{errors(refined, samples)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", nargs="?", type=Path, default=SHIPPED,
                        help="a profile JSON with samples (default: the shipped H100 + Llama-3.1-8B profile)")
    parser.add_argument("--model", default="dummy:llama-3.1-8b", help="the profile's model (its config)")
    parser.add_argument("--min-tokens", type=int, default=1024,
                        help="prefill steps of at least this many tokens count in the error by SMs")
    parser.add_argument("--compute-curve", action="append", default=[], metavar="SATURATION,KNEE",
                        help="also try a compute ceiling saturating at SATURATION SMs with this knee; repeatable")
    args = parser.parse_args(argv)
    curves = []
    for text in args.compute_curve:
        try:
            sat, knee = (float(x) for x in text.split(","))
        except ValueError:
            print(f"error: --compute-curve: want SATURATION,KNEE (e.g. 200,1), got {text!r}", file=sys.stderr)
            return 2
        if not (sat > 0 and knee > 0):
            print(f"error: --compute-curve: both must be > 0, got {text!r}", file=sys.stderr)
            return 2
        curves.append((sat, knee))
    if not args.profile.is_file():
        print(f"error: profile: {args.profile} is not a file", file=sys.stderr)
        return 2
    profile = load_profile(args.profile)
    if not profile.samples:
        print(f"error: profile: {args.profile} holds no samples", file=sys.stderr)
        return 2
    from bullet_ray.models.loader import resolve_source

    report(profile, PerfModel.from_profile(profile, resolve_source(args.model).config), curves, args.min_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
