"""A request as a worker sees it: its tokens, its KV blocks and its sampling state.

A sequence's known tokens are prompt + output. `num_computed_tokens` of them have their K/V in the pool;
the rest are the next step's input: the whole (remaining) prompt for a prefill, one token for a decode
step. After preemption the blocks are freed and `num_computed_tokens` drops to 0: the next prefill
recomputes prompt + output so far (recompute, as in vLLM) and samples the next token.

Asynchronous scheduling: a token sampled on the device is counted at once (`num_pending_tokens`) but its id
reaches the host one step later; until then the next step reads it from the device (the runner gathers it into
its input ids) and `output_token_ids` lacks it. Usually at most one is pending (the last launched step's); a
preempted sequence re-admitted and recomputed in the same plan can hold two (the older step is collected before
the next plan, so a step's input never needs more than the newest one gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bullet_ray.engine.outputs import FinishReason


@dataclass(frozen=True)
class SequenceWire:
    """A sequence in transit between processes (prefill -> engine -> decode, decode -> engine)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling: dict  # SamplingState.to_wire()
    block_ids: list[int]
    num_computed_tokens: int
    arrival_s: float
    max_model_len: int


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: Any  # bullet_ray.engine.sampler.SamplingState (owns params, RNG and output ids)
    arrival_s: float
    max_model_len: int
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    # tokens sampled on the device whose ids the host has not learned yet (0 or 1; 2 after a same-plan recompute)
    num_pending_tokens: int = 0

    @property
    def params(self) -> Any:
        return self.sampling.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.sampling.output_token_ids

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose ids the host holds: prompt + output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus the sampled ones still on the device."""
        return self.num_known_tokens + self.num_pending_tokens

    @property
    def is_length_capped(self) -> bool:
        """True when the pending token already reaches max_tokens or max_model_len: whatever its id, the
        sequence ends with it, so it is not scheduled again (no wasted step)."""
        return self.num_pending_tokens > 0 and (
            len(self.output_token_ids) + self.num_pending_tokens >= self.params.max_tokens
            or self.num_tokens >= self.max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) across prompt and output."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    def to_wire(self) -> SequenceWire:
        if self.num_pending_tokens:
            raise RuntimeError(f"sequence {self.request_id} cannot travel with a token still on the device")
        return SequenceWire(self.request_id, list(self.prompt_token_ids), list(self.output_token_ids),
                            self.sampling.to_wire(), list(self.block_ids), self.num_computed_tokens,
                            self.arrival_s, self.max_model_len)

    @classmethod
    def from_wire(cls, wire: SequenceWire) -> Sequence:
        from bullet_ray.engine.sampler import SamplingState

        sampling = SamplingState.from_wire(wire.sampling)
        return cls(wire.request_id, list(wire.prompt_token_ids), sampling, wire.arrival_s, wire.max_model_len,
                   list(wire.block_ids), wire.num_computed_tokens)

    def check_finished(self, token_id: int, eos_token_ids: tuple[int, ...]) -> bool:
        """Decide whether the token just appended ends the sequence; sets finish_reason."""
        params = self.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
            self.finish_reason, self.stop_reason = "stop", token_id
        elif len(self.output_token_ids) >= params.max_tokens or self.num_known_tokens >= self.max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None
