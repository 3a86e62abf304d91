"""Per-step SM split of the bullet schedule: how many SMs decode gets, the rest going to prefill.

The rule (DESIGN.md, per-GPU policy), applied whenever the decode side has finished a step on the split
last asked for:
- decode gets the fewest SMs with which its step is predicted to stay under the TPOT target with
  headroom (aim: `slack` x target), and prefill the rest, so prompts find prefill holding most of the GPU.
  When the predicted TTFT of a new request is over its target, the aim is the TPOT target itself, and if
  even that needs more than the middle of the ladder, the split balances at the middle;
- damping: a split whose predicted step lies between `hold_below` x the target and the aim is kept;
  decode gives up at most `max_shrink` ladder entries per decision but takes what it needs at once;
- decode with nothing to run keeps its split (it would restart slowly on a few SMs); until a decode step
  was measured, decode gets the most.
The policy spends SMs on meeting the targets, not on beating them: at light load decode runs near
slack x the TPOT target on few SMs rather than as fast as the whole GPU would let it.

Decode step time on `n` SMs comes from the last measured steps and how decode speed scales with SMs.
Decode is memory-bound (weights and KV reads), and a kernel's bandwidth grows with its SMs and then
saturates: `SmScaling` holds that curve as (fraction of the GPU's SMs, fraction of its bandwidth)
points, by default the H100's measured decode-like GEMV (GPU.md: 8/16/32/48/72/132 SMs give 27/51/75/
85/94/100% of the whole GPU's bandwidth). Each measured step is turned into its whole-GPU equivalent
(time x scaling(n)); an exponential average of those predicts the step on any other split (EMA / scaling).

Status: opt-in (`split_policy: slo`). Its first version (no damping, decode idle -> all SMs to prefill)
served less goodput than the fixed split on the Azure conversation sweep
(benchmarks/results/serve_h100/bullet-slo-policy) and moved the split 366 times in 45 s on the
split-trace workload (benchmarks/results/gpu_split_trace_h100_undamped.*); the damping above came from that
trace.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from bullet_ray.errors import ConfigError

# H100, decode-like GEMV (64 x 4096 @ 4096 x 14336), share of the whole GPU's bandwidth by share of its SMs
H100_DECODE_SCALING: tuple[tuple[float, float], ...] = (
    (8 / 132, 0.271), (16 / 132, 0.510), (32 / 132, 0.754), (48 / 132, 0.845), (72 / 132, 0.941), (1.0, 1.0))


class SmScaling:
    """Share of the whole GPU's decode speed a partition of `sms` SMs reaches (piecewise linear between the
    points, proportional below the first one)."""

    def __init__(self, sm_count: int, points: Sequence[tuple[float, float]] = H100_DECODE_SCALING) -> None:
        if sm_count < 1:
            raise ConfigError("sm_count", f"must be >= 1, got {sm_count}")
        pts = sorted(points)
        if not pts or any(not 0 < x <= 1 or not 0 < y <= 1 for x, y in pts):
            raise ConfigError("sm_scaling", f"points must be (share of SMs, share of speed) in (0, 1], got {points}")
        self.sm_count = sm_count
        self._xs = [x for x, _ in pts]
        self._ys = [y for _, y in pts]

    def __call__(self, sms: int) -> float:
        x = min(1.0, max(sms, 1) / self.sm_count)
        i = bisect.bisect_left(self._xs, x)
        if i == 0:
            return self._ys[0] * x / self._xs[0]
        if i == len(self._xs):
            return self._ys[-1]
        x0, x1, y0, y1 = self._xs[i - 1], self._xs[i], self._ys[i - 1], self._ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class SplitTargets:
    ttft_s: float = 0.5  # the strict preset of DESIGN.md's SLO conventions
    tpot_s: float = 0.025
    slack: float = 0.8  # aim decode at slack x the TPOT target, leaving headroom for batch growth

    def __post_init__(self) -> None:
        if self.ttft_s <= 0:
            raise ConfigError("ttft_target_ms", f"must be > 0, got {self.ttft_s * 1e3:g}")
        if self.tpot_s <= 0:
            raise ConfigError("tpot_target_ms", f"must be > 0, got {self.tpot_s * 1e3:g}")
        if not 0 < self.slack <= 1:
            raise ConfigError("slack", f"must be in (0, 1], got {self.slack}")


@dataclass(frozen=True)
class Load:
    """What the engine front sees at a decision."""

    num_decoding: int  # sequences on the decode side
    num_prefilling: int  # requests without a first token (waiting for or in prefill)
    predicted_ttft_s: float | None  # of a request arriving now; None before the prefill side was measured


class SplitPolicy:
    """Chooses a ladder index (decode SM counts in ascending order) from measured decode steps and the load."""

    def __init__(self, decode_sms: Sequence[int], scaling: SmScaling, targets: SplitTargets,
                 ema_weight: float = 0.3, hold_below: float = 0.6, max_shrink: int = 2) -> None:
        if not decode_sms or list(decode_sms) != sorted(decode_sms):
            raise ConfigError("decode_sm_counts", f"need ascending decode SM counts, got {list(decode_sms)}")
        self.decode_sms = list(decode_sms)
        self.scaling = scaling
        self.targets = targets
        self.ema_weight = ema_weight
        # a decode step predicted between hold_below x the TPOT target and the aim keeps the split
        self.hold_below = hold_below
        # ladder entries decode gives up per decision at most
        self.max_shrink = max_shrink
        self.full_gpu_step_s: float | None = None  # decode step time predicted on the whole GPU
        self._last_step = -1

    def observe_decode_step(self, step: int, step_time_s: float, index: int) -> bool:
        """A decode step the side published (its counter, wall time, ladder index); False when not new."""
        if step == self._last_step or step_time_s <= 0 or not 0 <= index < len(self.decode_sms):
            return False
        self._last_step = step
        full = step_time_s * self.scaling(self.decode_sms[index])
        ema = self.full_gpu_step_s
        self.full_gpu_step_s = full if ema is None else ema + self.ema_weight * (full - ema)
        return True

    def predicted_step_s(self, index: int) -> float | None:
        """Decode step time on ladder entry `index`; None before any decode step was seen."""
        if self.full_gpu_step_s is None:
            return None
        return self.full_gpu_step_s / self.scaling(self.decode_sms[index])

    def _fewest_meeting(self, limit_s: float) -> int:
        """The smallest index whose predicted decode step fits `limit_s` (the top one if none does)."""
        for i in range(len(self.decode_sms)):
            t = self.predicted_step_s(i)
            if t is not None and t <= limit_s:
                return i
        return len(self.decode_sms) - 1

    def choose(self, current: int, load: Load) -> int:
        """The ladder index to run the next steps on."""
        top = len(self.decode_sms) - 1
        if load.num_decoding == 0:
            return current  # an idle decode side keeps its SMs: it restarts without a slow first step
        if self.full_gpu_step_s is None:
            return top
        t = self.targets
        ttft_missed = load.predicted_ttft_s is not None and load.predicted_ttft_s > t.ttft_s
        aim = t.tpot_s if ttft_missed else t.slack * t.tpot_s
        now = self.predicted_step_s(current)
        if now is not None and self.hold_below * t.tpot_s <= now <= aim:
            return current  # inside the band: moving would only trade noise
        want = self._fewest_meeting(aim)
        if ttft_missed:
            want = min(want, top // 2)
        if want < current:
            want = max(want, current - self.max_shrink)  # give SMs away gradually, take them at once
        return want

    def describe(self) -> dict[str, float | list[int] | None]:
        step = self.full_gpu_step_s
        return {"decode_sms": self.decode_sms, "full_gpu_decode_step_ms": None if step is None else
                round(step * 1e3, 3), "tpot_target_ms": self.targets.tpot_s * 1e3,
                "ttft_target_ms": self.targets.ttft_s * 1e3}

