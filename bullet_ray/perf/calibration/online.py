"""Online correction of the model from measured step times while serving.

For each (phase, ladder entry) an exponential average of measured / predicted (the calibrated model's
prediction, before this correction) scales later predictions on that entry. An entry with fewer than
`min_samples` measurements uses the phase's average over all entries; a phase with none uses 1. Each ratio
is clamped to `bounds` before it enters an average, so one outlier step (a GC pause, a graph capture) moves
the factor by at most weight x (bound - factor), and the factor itself never leaves the bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from bullet_ray.errors import ConfigError
from bullet_ray.perf.kernels import Phase


@dataclass
class _Ewma:
    value: float = 1.0
    count: int = 0


class OnlineCorrection:
    def __init__(self, weight: float = 0.2, bounds: tuple[float, float] = (0.4, 2.5), min_samples: int = 3) -> None:
        if not 0 < weight <= 1:
            raise ConfigError("online_weight", f"must be in (0, 1], got {weight}")
        lo, hi = bounds
        if not 0 < lo <= 1 <= hi:
            raise ConfigError("online_bounds", f"need 0 < low <= 1 <= high, got {bounds}")
        self.weight = weight
        self.bounds = (lo, hi)
        self.min_samples = max(1, min_samples)
        self._entries: dict[tuple[str, int], _Ewma] = {}
        self._phases: dict[str, _Ewma] = {}

    def _update(self, avg: _Ewma, ratio: float) -> None:
        avg.value = ratio if avg.count == 0 else avg.value + self.weight * (ratio - avg.value)
        avg.count += 1

    def observe(self, phase: Phase, index: int, predicted_s: float, measured_s: float) -> None:
        """A step that ran on ladder entry `index`: `predicted_s` before correction, `measured_s` its time."""
        if predicted_s <= 0 or measured_s <= 0:
            return
        lo, hi = self.bounds
        ratio = min(hi, max(lo, measured_s / predicted_s))
        self._update(self._entries.setdefault((phase, index), _Ewma()), ratio)
        self._update(self._phases.setdefault(phase, _Ewma()), ratio)

    def factor(self, phase: Phase, index: int | None = None) -> float:
        """What to multiply the calibrated prediction by on entry `index` (None: the phase's average)."""
        entry = self._entries.get((phase, index)) if index is not None else None
        if entry is not None and entry.count >= self.min_samples:
            return entry.value
        avg = self._phases.get(phase)
        return avg.value if avg is not None and avg.count > 0 else 1.0

    def describe(self) -> dict[str, float]:
        return {f"{p}": round(a.value, 4) for p, a in self._phases.items()} | {
            f"{p}.{i}": round(a.value, 4) for (p, i), a in sorted(self._entries.items())}
