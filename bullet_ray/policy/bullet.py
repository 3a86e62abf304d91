"""BulletPolicy: one decision per step boundary (Bullet's Algorithm 1) from the performance model.

    order   = least_slack_order(queue)                          (ordering.py)
    batches = plan_batches(order, buckets, cap, saturation)     (batching.py, buckets.py)
    split   = SplitRule.decide(state, batches, planned)         (split.py; planned: fallback_planned_s)

and the predicted TTFT of every queued request on the chosen split. The batches are planned for the
current split's prefill SMs (not planned again for a new one); only the first `lookahead_batches` are
planned and judged (a decision must cost about a millisecond at most). Pure Python.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from bullet_ray.perf.model import SATURATION_SHARE, PerfModel
from bullet_ray.perf.ttft import batches_finish_s
from bullet_ray.policy.batching import plan_batches
from bullet_ray.policy.buckets import LengthBuckets
from bullet_ray.policy.ordering import head_target_s, least_slack_order
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.split import SplitRule, SplitSettings
from bullet_ray.policy.state import PolicyOutput, QueuedRequest, StepState

# seconds a prefill batch's saturation size is kept before it is computed again from the corrected model
SATURATION_REFRESH_S = 2.0


class BulletPolicy:
    def __init__(self, model: PerfModel, decode_sms: Sequence[int], sm_count: int, targets: SloTargets,
                 token_cap: int = 2048, settings: SplitSettings | None = None,
                 buckets: LengthBuckets | None = None, lookahead_batches: int = 8,
                 split_targets: SloTargets | None = None, backlog_batch_tokens: int | None = None,
                 prefill_order: str = "least_slack", saturation_share: float = SATURATION_SHARE) -> None:
        """`targets`: what the queue's order and the batches' fit plan for; `split_targets`: what the split rule
        judges TTFT risk and backlog by (None: `targets`; EngineConfig.split_targets); `backlog_batch_tokens`: how
        far a batch may grow past saturation while the split rule sees a backlog (None: never;
        EngineConfig.prefill_backlog_batch_tokens); `prefill_order`: how the queue is ordered (least_slack_order's
        `order`: least_slack, max_on_time or fallback_first; EngineConfig.prefill_order); `saturation_share`:
        a batch stops growing where the model puts throughput within this share of the best
        (EngineConfig.prefill_saturation_share)."""
        self.model = model
        self.rule = SplitRule(model, decode_sms, sm_count, targets if split_targets is None else split_targets,
                              settings)
        self.targets = targets
        self.token_cap = token_cap
        self.backlog_batch_tokens = backlog_batch_tokens
        self.prefill_order = prefill_order
        self.saturation_share = saturation_share
        self.buckets = buckets or LengthBuckets()
        self.lookahead_batches = lookahead_batches
        # (prefill SMs, decode busy) -> (saturation tokens, monotonic time computed): computed again after
        # SATURATION_REFRESH_S, since the online correction learns how fast each step size really runs
        self._saturation: dict[tuple[int, bool], tuple[int, float]] = {}

    @property
    def decode_sms(self) -> list[int]:
        return self.rule.decode_sms

    def saturation_tokens(self, sms: int, other_busy: bool = False, now_s: float | None = None) -> int:
        """Where a prefill batch on `sms` SMs stops growing (PerfModel.saturation_tokens at `saturation_share`,
        with the online correction as it stands, at most SATURATION_REFRESH_S old)."""
        now = time.monotonic() if now_s is None else now_s
        cached = self._saturation.get((sms, other_busy))
        if cached is None or not 0 <= now - cached[1] < SATURATION_REFRESH_S:  # stale, or a clock reset
            tokens = self.model.saturation_tokens(sms, share=self.saturation_share, max_tokens=max(self.token_cap, 64),
                                                  other_busy=other_busy)
            cached = self._saturation[(sms, other_busy)] = (tokens, now)
        return cached[0]

    def batch_tokens(self, state: StepState, sms: int, busy: bool) -> int:
        """Where a prefill batch stops growing (plan_batches caps it at the token cap too): at saturation, or, with
        `backlog_batch_tokens` while a queued request misses its target whatever the split (SplitRule.num_late), at
        the larger of the two: a backlog needs tokens per second more than a batch's first tokens."""
        tokens = self.saturation_tokens(sms, busy, state.now_s)
        if self.backlog_batch_tokens is not None and self.backlog_batch_tokens > tokens \
                and self.rule.num_late(state, busy):
            tokens = self.backlog_batch_tokens
        return tokens

    def plan(self, state: StepState, index: int) -> tuple[list[QueuedRequest], list[list[QueuedRequest]]]:
        """The queue's order and its first batches for the prefill side of ladder entry `index`."""
        sms = self.rule.prefill_sms(index)
        busy = state.decode.num_seqs > 0

        def own(r: QueuedRequest) -> float:
            return self.model.predict_prefill_s(r.num_remaining_tokens, r.num_prompt_tokens, sms, busy)

        order = least_slack_order(state.queue, own, self.targets, state.prefill_remaining_s,
                                  order=self.prefill_order)
        self.buckets.rebalance([r.num_prompt_tokens for r in state.queue])
        head_target = head_target_s(order[0], own(order[0]), self.targets, state.prefill_remaining_s) \
            if order else 0.0

        def fits(batch: list[QueuedRequest]) -> bool:
            t = self.model.predict_prefill_s(sum(r.num_remaining_tokens for r in batch),
                                             sum(r.num_prompt_tokens for r in batch), sms, busy, len(batch))
            head = batch[0]
            return head.waited_s + state.prefill_remaining_s + t <= head_target or \
                head.waited_s + state.prefill_remaining_s + own(head) > head_target
        batches = plan_batches(order, self.buckets, self.token_cap, self.batch_tokens(state, sms, busy), fits,
                               self.lookahead_batches)
        return order, batches

    def step(self, state: StepState) -> PolicyOutput:
        started = time.perf_counter()
        order, batches = self.plan(state, state.current_index)
        split = self.rule.decide(state, batches, self.fallback_planned_s(state, order))
        predicted = self.predicted_ttft_s(state, batches, split.index)
        return PolicyOutput(tuple(order), tuple(tuple(b) for b in batches), split, predicted,
                            time.perf_counter() - started)

    def fallback_planned_s(self, state: StepState, order: Sequence[QueuedRequest]) -> dict[str, float]:
        """With the fallback_first order, the requests it plans for their fallback target (served one after another
        in the order on the current entry, they end past their own target but within the fallback), each with that
        target: the split rule judges their TTFT risk by it, not by the target the order already let go (judged by
        their own, they made the rule take SMs from decode for requests the order meant to be late:
        benchmarks/results/replay_fallback_first_m14/). Empty for the other orders. The backlog (SplitRule.num_late)
        still counts a request by its own target."""
        if self.prefill_order != "fallback_first" or self.targets.fallback_ttft_s is None:
            return {}
        sms, busy = self.rule.prefill_sms(state.current_index), state.decode.num_seqs > 0
        t, planned = state.prefill_remaining_s, {}
        for r in order:
            t += self.model.predict_prefill_s(r.num_remaining_tokens, r.num_prompt_tokens, sms, busy)
            fallback = self.targets.fallback_target_s(r.num_prompt_tokens)
            if fallback is not None and self.targets.ttft_target_s(r.num_prompt_tokens) < r.waited_s + t <= fallback:
                # in the rule's own terms (its targets lack the margin with ttft_margin_scope "order")
                planned[r.request_id] = self.rule.targets.fallback_target_s(r.num_prompt_tokens) or fallback
        return planned

    def predicted_ttft_s(self, state: StepState, batches: Sequence[Sequence[QueuedRequest]],
                         index: int) -> dict[str, float]:
        finish = batches_finish_s(self.model, [[r.num_remaining_tokens for r in b] for b in batches],
                                  self.rule.prefill_sms(index), state.decode.num_seqs > 0,
                                  state.prefill_remaining_s, index)
        return {r.request_id: r.waited_s + f for b, f in zip(batches, finish) for r in b}

    def predict_new_ttft_s(self, state: StepState, num_prompt_tokens: int) -> float:
        """TTFT of a request of `num_prompt_tokens` arriving now, behind every queued prompt (a bound:
        least-slack ordering may serve it sooner) on the current split: what admission and the router read."""
        index = state.current_index
        sms = self.rule.prefill_sms(index)
        busy = state.decode.num_seqs > 0
        queued = sum(r.num_remaining_tokens for r in state.queue)
        cap = max(1, self.token_cap)
        t = state.prefill_remaining_s
        total = queued + num_prompt_tokens
        full, rest = divmod(total, cap)
        if full:
            t += full * self.model.predict_prefill_s(cap, cap, sms, busy, index=index)
        if rest:
            t += self.model.predict_prefill_s(rest, rest, sms, busy, index=index)
        return t

    def ttft_per_prompt_token_s(self, state: StepState) -> float:
        """How much longer `predict_new_ttft_s` gets per prompt token more: a full batch's prefill time per
        token on the current split (admission scales the typical request's prediction to a given prompt)."""
        index = state.current_index
        cap = max(1, self.token_cap)
        return self.model.predict_prefill_s(cap, cap, self.rule.prefill_sms(index), state.decode.num_seqs > 0,
                                            index=index) / cap
