"""Per-request sampling parameters (OpenAI's names where they exist) and their validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from bullet_ray.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20


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

    def __post_init__(self) -> None:
        # callers may pass a str or a list for stop / stop_token_ids: normalize to tuples
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        _check(isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
               and self.temperature >= 0, "temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k",
               f"must be -1 (all tokens) or >= 1, got {self.top_k!r}")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
               "repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
               f"must be null or an integer in [0, 2^63), got {self.seed!r}")
        _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        _check(all(isinstance(s, str) and s for s in stop), "stop", "stop strings must be non-empty strings")
        _check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               f"must be non-negative integers, got {list(self.stop_token_ids)!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_openai(cls, body: dict[str, Any], default_max_tokens: int = 16) -> SamplingParams:
        """Build from an OpenAI /v1/completions or /v1/chat/completions body (plus vLLM's extras)."""
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        logprobs = body.get("logprobs")
        if isinstance(logprobs, bool):  # chat: logprobs is a flag, top_logprobs the count
            logprobs = int(body.get("top_logprobs") or 0) if logprobs else None
        kwargs: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "seed": body.get("seed"),
            "logprobs": logprobs,
            "stop": body.get("stop") or (),
        }
        for name in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                     "ignore_eos", "stop_token_ids", "skip_special_tokens"):
            if body.get(name) is not None:
                kwargs[name] = body[name]
        return cls(**kwargs)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(field_name, message)
