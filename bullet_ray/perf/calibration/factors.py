"""Calibration factors of the roofline, per phase: what a step really costs next to the ceilings.

    step_s = overhead_s + linear x T_linear(n) + attention x T_attention(n)      (the other side idle)
    step_s x (1 + corun_slowdown)                                               (the other side busy)

T_linear and T_attention are the roofline times (bullet_ray.perf.roofline) of the step's weight GEMMs
(qkv, o, gate_up, down, lm_head) and of its attention kernel on n SMs; `linear` and `attention` are
inverse efficiencies (1.25 = 80% of the ceiling); `overhead_s` is the fixed cost of a step (launches, host
planning, the small kernels the model does not count); `corun_slowdown` is the share a step slows down by
when the other side runs at the same time (shared power, L2 and memory: +9% / +11% for decode / prefill
GEMMs in two MPS processes on the H100, GPU.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bullet_ray.errors import ConfigError
from bullet_ray.perf.kernels import PHASES, Phase


@dataclass(frozen=True)
class PhaseCalibration:
    overhead_s: float = 0.0  # fixed seconds per step (>= 0)
    linear: float = 1.0  # inverse efficiency of the weight GEMMs (> 0)
    attention: float = 1.0  # inverse efficiency of attention (> 0)
    corun_slowdown: float = 0.0  # extra share of step time while the other side runs (>= 0)

    def __post_init__(self) -> None:
        if self.overhead_s < 0:
            raise ConfigError("calibration.overhead_s", f"must be >= 0, got {self.overhead_s}")
        for name in ("linear", "attention"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"calibration.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.corun_slowdown < 0:
            raise ConfigError("calibration.corun_slowdown", f"must be >= 0, got {self.corun_slowdown}")

    def time_s(self, linear_s: float, attention_s: float, other_busy: bool) -> float:
        alone = self.overhead_s + self.linear * linear_s + self.attention * attention_s
        return alone * (1.0 + self.corun_slowdown) if other_busy else alone


@dataclass(frozen=True)
class Calibration:
    prefill: PhaseCalibration = field(default_factory=PhaseCalibration)
    decode: PhaseCalibration = field(default_factory=PhaseCalibration)

    def of(self, phase: Phase) -> PhaseCalibration:
        return self.prefill if phase == "prefill" else self.decode

    def to_dict(self) -> dict[str, Any]:
        return {"prefill": asdict(self.prefill), "decode": asdict(self.decode)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        phases = {}
        for phase in PHASES:
            raw = d.get(phase, {})
            if not isinstance(raw, dict):
                raise ConfigError(f"calibration.{phase}", f"must be an object, got {raw!r}")
            unknown = sorted(set(raw) - {"overhead_s", "linear", "attention", "corun_slowdown"})
            if unknown:
                raise ConfigError(f"calibration.{phase}.{unknown[0]}", "unknown calibration factor")
            phases[phase] = PhaseCalibration(**{k: float(v) for k, v in raw.items()})
        return cls(**phases)
