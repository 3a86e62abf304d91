"""Online correction of the model from measured step times while serving.

An exponential average of measured / predicted (the calibrated model's prediction, before this correction)
is kept at three levels, and a prediction is multiplied by the most specific one with enough samples:

    (phase, ladder entry, size bucket)  ->  (phase, size bucket)  ->  phase  ->  1

The size bucket is floor(log2(size)), size = the step's new tokens for prefill, its batch for decode: the
calibrated model's error depends on the step's size (a 200-token prefill step is overhead-bound, an
8,000-token one compute-bound) as much as on the SMs, and one factor per entry mixed them. A level with
fewer than `min_samples` measurements defers to the next. Each ratio is clamped to `bounds` before it
enters an average, so one outlier step (a GC pause, a graph capture) moves a factor by at most weight x
(bound - factor), and no factor leaves the bounds.

Replayed over two H100 serving runs' step logs (`python -m benchmarks.replay_online`,
benchmarks/results/replay_online_h100.json), prefill steps' error median / p90 goes from 13.3% / 32.6% to
5.7% / 21.9% (conversation trace) and from 16.8% / 48.4% to 5.9% / 30.2% (code trace) against one factor
per entry; decode steps stay at ~1% / 10-12%.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bullet_ray.errors import ConfigError
from bullet_ray.perf.kernels import Phase


@dataclass
class _Ewma:
    value: float = 1.0
    count: int = 0


def size_bucket(size: int) -> int:
    """floor(log2(size)) for size >= 1 (0 for less)."""
    return max(1, size).bit_length() - 1


class OnlineCorrection:
    def __init__(self, weight: float = 0.3, bounds: tuple[float, float] = (0.4, 2.5), min_samples: int = 3) -> None:
        if not 0 < weight <= 1:
            raise ConfigError("online_weight", f"must be in (0, 1], got {weight}")
        lo, hi = bounds
        if not 0 < lo <= 1 <= hi:
            raise ConfigError("online_bounds", f"need 0 < low <= 1 <= high, got {bounds}")
        self.weight = weight
        self.bounds = (lo, hi)
        self.min_samples = max(1, min_samples)
        self._entries: dict[tuple[str, int, int], _Ewma] = {}
        self._sizes: dict[tuple[str, int], _Ewma] = {}
        self._phases: dict[str, _Ewma] = {}

    def _update(self, avg: _Ewma, ratio: float) -> None:
        avg.value = ratio if avg.count == 0 else avg.value + self.weight * (ratio - avg.value)
        avg.count += 1

    def observe(self, phase: Phase, index: int, predicted_s: float, measured_s: float, size: int = 1) -> None:
        """A step of `size` (new tokens for prefill, batch for decode) that ran on ladder entry `index`:
        `predicted_s` before correction, `measured_s` its time."""
        if predicted_s <= 0 or measured_s <= 0 or not math.isfinite(measured_s):
            return
        lo, hi = self.bounds
        ratio = min(hi, max(lo, measured_s / predicted_s))
        bucket = size_bucket(size)
        self._update(self._entries.setdefault((phase, index, bucket), _Ewma()), ratio)
        self._update(self._sizes.setdefault((phase, bucket), _Ewma()), ratio)
        self._update(self._phases.setdefault(phase, _Ewma()), ratio)

    def factor(self, phase: Phase, index: int | None = None, size: int = 1) -> float:
        """What to multiply the calibrated prediction of a step of `size` on entry `index` by (index None:
        the entry level is skipped)."""
        bucket = size_bucket(size)
        if index is not None:
            entry = self._entries.get((phase, index, bucket))
            if entry is not None and entry.count >= self.min_samples:
                return entry.value
        by_size = self._sizes.get((phase, bucket))
        if by_size is not None and by_size.count >= self.min_samples:
            return by_size.value
        avg = self._phases.get(phase)
        return avg.value if avg is not None and avg.count > 0 else 1.0

    def describe(self) -> dict[str, float]:
        return {f"{p}": round(a.value, 4) for p, a in self._phases.items()} | {
            f"{p}.size{b}": round(a.value, 4) for (p, b), a in sorted(self._sizes.items())} | {
            f"{p}.{i}.size{b}": round(a.value, 4) for (p, i, b), a in sorted(self._entries.items())}
