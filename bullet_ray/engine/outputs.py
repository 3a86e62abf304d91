"""What the engine hands back to callers: per-request output deltas and engine-wide statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token and of the most likely alternatives at that step."""

    token_id: int
    logprob: float
    # (token_id, logprob) of the top-n tokens, most likely first; empty when logprobs=0
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class RequestOutput:
    """One streamed update of a request: everything new since the previous update.

    A stream yields one or more of these; the last has `finished=True`. Concatenating `text_delta`
    (and `token_ids_delta`) over the stream gives the full output.
    """

    request_id: str
    # token ids generated since the previous update (stop-string truncation never removes ids)
    token_ids_delta: list[int]
    # detokenized text since the previous update (stop strings and partial stop strings held back)
    text_delta: str
    # logprobs of the tokens in token_ids_delta, when the request asked for logprobs
    logprobs_delta: list[TokenLogprob] | None
    num_prompt_tokens: int
    # generated tokens so far, this update included
    num_output_tokens: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    # the stop string or stop token that ended the request, if any
    stop_reason: str | int | None = None
    # human-readable error when finish_reason == "error"
    error: str | None = None
    # latency figures (seconds since the request arrived), set when known
    ttft_s: float | None = None
    e2e_s: float | None = None


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """One update equal to `first` followed by `then` (deltas joined; state and figures from `then`)."""
    logprobs = None
    if first.logprobs_delta is not None or then.logprobs_delta is not None:
        logprobs = (first.logprobs_delta or []) + (then.logprobs_delta or [])
    return RequestOutput(
        request_id=then.request_id, token_ids_delta=first.token_ids_delta + then.token_ids_delta,
        text_delta=first.text_delta + then.text_delta, logprobs_delta=logprobs,
        num_prompt_tokens=then.num_prompt_tokens, num_output_tokens=then.num_output_tokens,
        finished=then.finished, finish_reason=then.finish_reason, stop_reason=then.stop_reason, error=then.error,
        ttft_s=first.ttft_s if first.ttft_s is not None else then.ttft_s, e2e_s=then.e2e_s)


@dataclass(frozen=True)
class CompletionOutput:
    """The whole result of one request (what `LLMEngine.generate` returns)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load, for routers, admission and metrics."""

    num_waiting: int  # submitted, no first token yet (queued or prefilling)
    num_running: int  # decoding
    num_kv_blocks: int
    num_free_kv_blocks: int
    # sequences sent back for recompute so far: preempted while running, or a waiting prompt's KV released
    num_preemptions: int = 0
    # predicted TTFT (s) of a request of typical length (`predicted_ttft_prompt_tokens`) arriving now; None until
    # the policy has a model
    predicted_ttft_s: float | None = None
    predicted_ttft_prompt_tokens: int | None = None
    # how much longer that TTFT is per prompt token more (s); None: unknown (then the typical one stands for all)
    ttft_per_prompt_token_s: float | None = None
    # the decoding side's recent wall time per step (s; averaged over the windows between stats() calls:
    # what a running request's TPOT is now); None while nothing decodes
    recent_decode_step_s: float | None = None
    # per-side figures of the last step (see the shared state block)
    extra: dict = field(default_factory=dict)

    def predicted_ttft_for(self, num_prompt_tokens: int | None) -> float | None:
        """Predicted TTFT of a request of `num_prompt_tokens` arriving now: the typical request's, moved by the
        per-token part for its length (never below 0); the typical one where either is unknown."""
        typical, per_token = self.predicted_ttft_prompt_tokens, self.ttft_per_prompt_token_s
        if self.predicted_ttft_s is None or num_prompt_tokens is None or typical is None or per_token is None:
            return self.predicted_ttft_s
        return max(0.0, self.predicted_ttft_s + (num_prompt_tokens - typical) * per_token)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1."""
        if self.num_kv_blocks == 0:
            return 0.0
        return 1.0 - self.num_free_kv_blocks / self.num_kv_blocks
