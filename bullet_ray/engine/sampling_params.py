"""Per-request sampling parameters (OpenAI's names where they exist) and their validation."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction (InvalidSamplingParams)."""

    # 0 = greedy; > 0 scales logits before sampling
    temperature: float = 1.0
    # nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; (0, 1]
    top_p: float = 1.0
    # keep the k most likely tokens; -1 (or 0) = all
    top_k: int = -1
    # drop tokens whose probability is below min_p x the top token's; [0, 1]
    min_p: float = 0.0
    # per-request RNG seed: the same seed and prompt give the same text; None = nondeterministic
    seed: int | None = None
    # generated-token budget (>= 1)
    max_tokens: int = 16
    # do not stop at the model's EOS tokens
    ignore_eos: bool = False
    # strings that end generation; the matched string is not part of the output text
    stop: tuple[str, ...] = ()
    # token ids that end generation (in addition to EOS unless ignore_eos); the token is not returned as text
    stop_token_ids: tuple[int, ...] = ()
    # return the log-probability of the sampled token and of the `logprobs` most likely ones; None = off
    logprobs: int | None = None
    # OpenAI presence / frequency penalties, [-2, 2]; applied to tokens generated so far
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/vLLM repetition penalty (> 0, 1 = off); applied to prompt and generated tokens
    repetition_penalty: float = 1.0
    # tokens returned in the final output text; skip special tokens when detokenizing
    skip_special_tokens: bool = True
    # extra fields the engine ignores (kept so callers can round-trip)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
