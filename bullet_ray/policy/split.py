"""The SM split rule of the bullet schedule (Bullet's Algorithm 1, split step), from the performance model.

The ladder gives decode d_i SMs and prefill the rest (d ascending). At each step boundary, with the
decode step predicted on every entry (D_i, the other side busy) and the queued requests' TTFT predicted on
the current entry (their planned batches on its prefill SMs):

- neither side has work                -> IDLE: keep the split;
- nothing decodes                      -> ONLY_PREFILL: the entry with the most prefill SMs;
- nothing to prefill                   -> ONLY_DECODE: the fewest decode SMs with D_i <= aim x TPOT, D_i
                                          predicted with prefill busy (`idle_decode` "aim"; the most if none):
                                          a TPOT under its target earns no goodput, and the next prompt finds
                                          prefill with its share; or ("fastest") the fewest within
                                          `idle_margin` of the fastest decode step;
- TTFT at risk and D_cur > TPOT target -> BALANCE: argmin_i max(D_i / TPOT, max_r TTFT_r,i / target_r)
                                          (a binary search: the first term falls with i, the second rises);
                                          with `balance` "tpot_first", BALANCE_TPOT: the fewest decode SMs
                                          with D_i <= TPOT target, never fewer than now (one more when only
                                          the measured step is over; minimax only if none meets it);
- TTFT at risk                         -> TO_PREFILL: the fewest decode SMs with D_i <= TPOT target;
- a backlog (a queued request misses   -> BACKLOG: the fewest decode SMs with D_i <= `backlog_aim` x TPOT
  its target even alone on the most       (the most if none; decode gives up at most `max_shrink` entries):
  prefill SMs)                            late requests still need prefill capacity, and requests behind
                                          them wait for it;
- D_cur outside [hold_below, aim] x TPOT -> the fewest decode SMs with D_i <= aim x TPOT (TO_PREFILL when
                                          that is fewer than now, TO_DECODE otherwise; the most if none);
- else                                 -> HOLD.

Hysteresis: inside the band the split holds; decode gives up at most `max_shrink` entries per decision
(it takes what it needs at once); an ordinary move (TO_PREFILL / TO_DECODE without TTFT at risk) waits
`min_dwell_s` after the previous move. "At risk" counts only requests that can still meet their target;
the others are the backlog. Without the BACKLOG rule a queue of late requests left decode at its
comfortable `aim` (H100 conversation run, docs/policy.md section 6): prefill stayed short of SMs while the
backlog grew, and the late requests waited seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from bullet_ray.errors import ConfigError
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.ttft import batches_finish_s
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import QueuedRequest, SplitDecision, SplitReason, StepState


@dataclass(frozen=True)
class SplitSettings:
    aim: float = 0.85  # decode aims at aim x the TPOT target (headroom for batch growth)
    hold_below: float = 0.6  # a decode step predicted in [hold_below, aim] x target keeps the split
    max_shrink: int = 2  # ladder entries decode gives up per decision at most
    min_dwell_s: float = 0.02  # an ordinary move waits this long after the previous one
    idle_margin: float = 0.05  # ONLY_DECODE: the fewest SMs within this share of the fastest decode step
    backlog_aim: float | None = 0.95  # BACKLOG: decode keeps its step under this x TPOT (None: no BACKLOG rule)
    idle_decode: str = "aim"  # ONLY_DECODE: "aim" (the SMs that meet aim x TPOT) or "fastest" (idle_margin)
    # TTFT at risk with decode over its TPOT target: "minimax" (BALANCE, Bullet's: argmin max(D_i / TPOT, worst at-risk
    # TTFT_i / target)) or "tpot_first" (BALANCE_TPOT: the fewest decode SMs whose step meets the TPOT target, never
    # fewer than now, as TO_PREFILL: TTFT at risk takes only decode's slack under the target, which every running
    # sequence is owed; minimax only when no entry meets it). Opt-in, unmeasured: the
    # TPOT misses of serve_h200_m6/seed1 at 40 req/s came from minimax holding decode up to 37% over target for 1.3 s
    balance: str = "minimax"

    def __post_init__(self) -> None:
        if not 0 < self.hold_below < self.aim <= 1:
            raise ConfigError("split.aim", f"need 0 < hold_below < aim <= 1, got {self.hold_below}, {self.aim}")
        if self.backlog_aim is not None and not self.aim <= self.backlog_aim <= 1:
            raise ConfigError("split.backlog_aim", f"need aim <= backlog_aim <= 1, got {self.aim}, {self.backlog_aim}")
        if self.idle_decode not in ("aim", "fastest"):
            raise ConfigError("split.idle_decode", f"choose aim or fastest, got {self.idle_decode!r}")
        if self.balance not in ("minimax", "tpot_first"):
            raise ConfigError("split.balance", f"choose minimax or tpot_first, got {self.balance!r}")
        if isinstance(self.max_shrink, bool) or not isinstance(self.max_shrink, int):
            raise ConfigError("split.max_shrink", f"need a whole number of ladder entries, got {self.max_shrink!r}")
        if self.max_shrink < 1 or self.min_dwell_s < 0 or self.idle_margin < 0:
            raise ConfigError("split", f"max_shrink >= 1, min_dwell_s >= 0, idle_margin >= 0; got "
                              f"{self.max_shrink}, {self.min_dwell_s}, {self.idle_margin}")


class SplitRule:
    def __init__(self, model: PerfModel, decode_sms: Sequence[int], sm_count: int, targets: SloTargets,
                 settings: SplitSettings | None = None) -> None:
        if not decode_sms or list(decode_sms) != sorted(decode_sms) or decode_sms[-1] >= sm_count:
            raise ConfigError("decode_sm_counts", f"need ascending decode SM counts below {sm_count}, "
                              f"got {list(decode_sms)}")
        self.model = model
        self.decode_sms = list(decode_sms)
        self.sm_count = sm_count
        self.targets = targets
        self.settings = settings or SplitSettings()
        self.last_move_s = -math.inf

    def prefill_sms(self, index: int) -> int:
        return self.sm_count - self.decode_sms[index]

    def decode_step_s(self, state: StepState, index: int, other_busy: bool = True) -> float:
        d = state.decode
        return self.model.predict_decode_s(d.num_seqs, d.num_context_tokens, self.decode_sms[index], other_busy,
                                           index)

    def _makes_it_alone(self, state: StepState, r: QueuedRequest, decode_busy: bool) -> bool:
        """Whether `r` meets its TTFT target prefilled alone, now, on the entry with the most prefill SMs."""
        alone = r.waited_s + state.prefill_remaining_s + self.model.predict_prefill_s(
            r.num_remaining_tokens, r.num_prompt_tokens, self.prefill_sms(0), decode_busy)
        return alone <= self.targets.ttft_target_s(r.num_prompt_tokens)

    def feasible(self, state: StepState, batches: Sequence[Sequence[QueuedRequest]], decode_busy: bool) -> set[str]:
        """Ids of the planned requests that can still meet their TTFT target (computed once per decision;
        it does not depend on the entry)."""
        return {r.request_id for batch in batches for r in batch if self._makes_it_alone(state, r, decode_busy)}

    def num_late(self, state: StepState, decode_busy: bool) -> int:
        """Queued requests (the whole queue, not only the planned batches) that miss their TTFT target
        whatever the split: the backlog."""
        return sum(not self._makes_it_alone(state, r, decode_busy) for r in state.queue)

    def ttft_outlook(self, state: StepState, batches: Sequence[Sequence[QueuedRequest]], index: int,
                     decode_busy: bool, feasible: set[str],
                     planned_s: Mapping[str, float] | None = None) -> tuple[int, float | None, float]:
        """(requests at risk that can still make it, worst slack, worst TTFT / target among those that can)
        on entry `index`; `planned_s`: the target a request is planned for where the order plans it for a later
        one than its own (its fallback: BulletPolicy.fallback_planned_s), judged by that one."""
        if not batches:
            return 0, None, 0.0
        finish = batches_finish_s(self.model, [[r.num_remaining_tokens for r in b] for b in batches],
                                  self.prefill_sms(index), decode_busy, state.prefill_remaining_s, index)
        at_risk, worst_slack, worst_ratio = 0, math.inf, 0.0
        for batch, done in zip(batches, finish):
            for r in batch:
                target = (planned_s or {}).get(r.request_id) or self.targets.ttft_target_s(r.num_prompt_tokens)
                ttft = r.waited_s + done
                worst_slack = min(worst_slack, target - ttft)
                if r.request_id in feasible:
                    at_risk += ttft > target
                    worst_ratio = max(worst_ratio, ttft / target)
        return at_risk, worst_slack, worst_ratio

    def _fewest_meeting(self, steps: Sequence[float], limit_s: float) -> int | None:
        return next((i for i, t in enumerate(steps) if t <= limit_s), None)

    def decide(self, state: StepState, batches: Sequence[Sequence[QueuedRequest]],
               planned_s: Mapping[str, float] | None = None) -> SplitDecision:
        """The split for the next steps; `planned_s`: ttft_outlook's, for every judgement of TTFT risk."""
        cur, top = state.current_index, len(self.decode_sms) - 1
        if not 0 <= cur <= top:
            raise ConfigError("split_index", f"current index {cur} outside [0, {top}]")
        s, tpot = self.settings, self.targets.tpot_s
        has_decode, has_prefill = state.decode.num_seqs > 0, bool(batches)
        if not has_decode and not has_prefill:
            return SplitDecision(cur, SplitReason.IDLE, None, 0, None)
        if not has_decode:
            risk, slack, _ = self.ttft_outlook(state, batches, 0, False, self.feasible(state, batches, False),
                                               planned_s)
            return self._moved(state, SplitDecision(0, SplitReason.ONLY_PREFILL, None, risk, slack))
        steps = [self.decode_step_s(state, i, other_busy=has_prefill) for i in range(top + 1)]
        if not has_prefill:
            if s.idle_decode == "aim":
                busy = [self.decode_step_s(state, i, other_busy=True) for i in range(top + 1)]
                fit = self._fewest_meeting(busy, s.aim * tpot)
                want = top if fit is None else fit
            else:
                near_fastest = self._fewest_meeting(steps, min(steps) * (1 + s.idle_margin))
                assert near_fastest is not None  # the fastest entry itself qualifies
                want = near_fastest
            return self._moved(state, SplitDecision(want, SplitReason.ONLY_DECODE, steps[want], 0, None))
        feasible = self.feasible(state, batches, True)
        risk, slack, _ = self.ttft_outlook(state, batches, cur, True, feasible, planned_s)
        measured = state.decode.measured_step_s
        over = steps[cur] > tpot or (measured is not None and measured > tpot and steps[cur] > s.aim * tpot)
        fit_tpot = self._fewest_meeting(steps, tpot) if risk and over and s.balance == "tpot_first" else None
        if fit_tpot is not None:  # balance "tpot_first": decode keeps its target, prefill gets the rest
            # never fewer decode SMs while decode is over its target; one more where only the measured step is over
            # (the model says the current entry meets it)
            want, reason = max(fit_tpot, cur), SplitReason.BALANCE_TPOT
            if want == cur and measured is not None and measured > tpot:
                want = min(cur + 1, top)
        elif risk and over:
            # D_i / TPOT falls and TTFT_i / target rises with i: the minimax sits where they cross
            ratios: dict[int, float] = {}

            def ratio(i: int) -> float:
                if i not in ratios:
                    ratios[i] = self.ttft_outlook(state, batches, i, True, feasible, planned_s)[2]
                return ratios[i]

            lo, hi = 0, top
            while lo < hi:
                mid = (lo + hi) // 2
                if steps[mid] / tpot > ratio(mid):
                    lo = mid + 1
                else:
                    hi = mid
            candidates = [i for i in (lo - 1, lo) if 0 <= i <= top]
            want = min(candidates, key=lambda i: (max(steps[i] / tpot, ratio(i)), -i))
            reason = SplitReason.BALANCE
        elif risk:
            fit = self._fewest_meeting(steps, tpot)
            want, reason = (cur if fit is None else min(fit, cur)), SplitReason.TO_PREFILL
        elif s.backlog_aim is not None and self.num_late(state, True):
            fit = self._fewest_meeting(steps, s.backlog_aim * tpot)
            want, reason = (top if fit is None else fit), SplitReason.BACKLOG
            if want < cur:
                want = max(want, cur - s.max_shrink)
        elif s.hold_below * tpot <= steps[cur] <= s.aim * tpot:
            return SplitDecision(cur, SplitReason.HOLD, steps[cur], risk, slack)
        else:
            fit = self._fewest_meeting(steps, s.aim * tpot)
            want = top if fit is None else fit
            reason = SplitReason.TO_PREFILL if want < cur else SplitReason.TO_DECODE
            if want < cur:
                want = max(want, cur - s.max_shrink)
            if want != cur and state.now_s - self.last_move_s < s.min_dwell_s:
                return SplitDecision(cur, SplitReason.HOLD, steps[cur], risk, slack)
        if want == cur:
            kept = (SplitReason.BALANCE, SplitReason.BALANCE_TPOT, SplitReason.BACKLOG)
            return SplitDecision(cur, reason if reason in kept else SplitReason.HOLD,
                                 steps[cur], risk, slack)
        risk, slack, _ = self.ttft_outlook(state, batches, want, True, feasible, planned_s)
        return self._moved(state, SplitDecision(want, reason, steps[want], risk, slack))

    def _moved(self, state: StepState, decision: SplitDecision) -> SplitDecision:
        if decision.index != state.current_index:
            self.last_move_s = state.now_s
        return decision
