"""What the policy reads at a step boundary and what it answers: plain frozen dataclasses."""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for (or in the middle of) its prefill."""

    request_id: str
    num_prompt_tokens: int
    waited_s: float  # since it arrived
    num_computed_tokens: int = 0  # prompt tokens already prefilled (a chunked prompt in progress)

    @property
    def num_remaining_tokens(self) -> int:
        return max(1, self.num_prompt_tokens - self.num_computed_tokens)


@dataclass(frozen=True)
class DecodeLoad:
    num_seqs: int  # sequences the decode side runs
    num_context_tokens: int  # their KV tokens in all
    measured_step_s: float | None = None  # the last decode step's wall time (None: none yet)


@dataclass(frozen=True)
class StepState:
    """Both sides at a step boundary."""

    current_index: int  # ladder entry both sides run on (or are moving to)
    queue: tuple[QueuedRequest, ...]  # prefill side's requests, in arrival order
    decode: DecodeLoad
    now_s: float  # monotonic clock (hysteresis timing)
    prefill_remaining_s: float = 0.0  # time left of a prefill step running now


class SplitReason(str, enum.Enum):
    BALANCE = "balance"  # TTFT at risk and TPOT over target: the split that evens the two out
    TO_PREFILL = "to_prefill"  # decode has slack (or TTFT is at risk): fewest decode SMs that keep TPOT
    TO_DECODE = "to_decode"  # decode is over its aim: the SMs it needs
    ONLY_PREFILL = "only_prefill"  # nothing decodes: prefill takes all it can
    ONLY_DECODE = "only_decode"  # nothing to prefill: decode takes what speeds it up
    IDLE = "idle"  # neither side has work: keep the split
    HOLD = "hold"  # inside the hysteresis band, or too soon after the last move
    BACKLOG = "backlog"  # queued requests already miss their TTFT: decode keeps only what holds its TPOT
    MIXED = "mixed"  # overload (mixed_fallback_tokens): decode takes the prompts in chunks, on the most SMs
    # (appended last: the state block stores a reason's index in this order)
    BALANCE_TPOT = "balance_tpot"  # TTFT at risk and TPOT over target, split_rule.balance tpot_first: decode's target


@dataclass(frozen=True)
class SplitDecision:
    index: int  # ladder entry to run on
    reason: SplitReason
    decode_step_s: float | None  # predicted decode step on that entry (None: nothing decodes)
    num_ttft_at_risk: int  # queued requests predicted to miss their TTFT target on that entry (that can still meet it)
    worst_ttft_slack_s: float | None  # min over queued requests of target - predicted TTFT on that entry


@dataclass(frozen=True)
class PolicyOutput:
    order: tuple[QueuedRequest, ...]  # the prefill queue as it should run
    batches: tuple[tuple[QueuedRequest, ...], ...]  # the planned prefill batches, first runs next
    split: SplitDecision
    predicted_ttft_s: dict[str, float]  # per queued request, on the chosen split
    decision_s: float  # time the decision took (for the metrics)
