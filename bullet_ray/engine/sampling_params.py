"""Per-request sampling parameters (OpenAI's names where they exist) and their validation.

`SamplingParams` is what the engine sees; `SamplingParams.from_openai` maps an OpenAI /v1/completions or
/v1/chat/completions body (plus vLLM's extras) onto it. Every bad value raises InvalidSamplingParams
naming the field (OpenAI's name), the value and the allowed range, so the ingress can answer 400.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bullet_ray.errors import InvalidSamplingParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_SEED = 2**63  # exclusive: seeds are non-negative int64
MAX_LOGIT_BIAS_TOKENS = 1024  # entries of one request's logit_bias
LOGIT_BIAS_RANGE = 100.0  # OpenAI's bounds: each bias in [-100, 100]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction (InvalidSamplingParams).

    `stop` and `stop_token_ids` accept a str / list from callers and are normalized to tuples;
    numeric fields given as ints (temperature=0) are normalized to float.
    """

    # 0 = greedy (argmax of the logits after penalties); > 0 divides the logits before sampling
    temperature: float = 1.0
    # nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p; (0, 1]
    top_p: float = 1.0
    # keep the k most likely tokens; -1 (or 0) = all
    top_k: int = -1
    # drop tokens whose probability is below min_p x the top token's; [0, 1]
    min_p: float = 0.0
    # per-request RNG seed in [0, 2^63): the same seed and prompt give the same text; None = nondeterministic
    seed: int | None = None
    # generated-token budget (>= 1)
    max_tokens: int = 16
    # max_tokens is the server's default, not the request's: a prompt too long for prompt + default within the
    # context then gets what the context leaves (as vLLM does) instead of an error
    max_tokens_is_default: bool = False
    # do not stop at the model's EOS tokens
    ignore_eos: bool = False
    # strings that end generation (at most 16); the matched string is not part of the output text
    stop: tuple[str, ...] = ()
    # token ids that end generation (in addition to EOS unless ignore_eos); the token is not returned as text
    stop_token_ids: tuple[int, ...] = ()
    # return the log-probability of the sampled token and of the `logprobs` most likely ones (0..20); None = off
    logprobs: int | None = None
    # OpenAI presence / frequency penalties, [-2, 2]; applied to tokens generated so far
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # HF/vLLM repetition penalty (> 0, 1 = off); applied to prompt and generated tokens
    repetition_penalty: float = 1.0
    # OpenAI logit_bias: added to the model's logits of these token ids before penalties and sampling, each in
    # [-100, 100] (-100 bans a token, 100 all but forces it); a {token id: bias} mapping from callers, kept as
    # sorted (id, bias) pairs. The engine checks the ids against the vocabulary.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # skip special tokens (EOS, chat markers) when detokenizing the output text
    skip_special_tokens: bool = True
    # extra fields the engine ignores (kept so callers can round-trip)
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalize in place
        set_(self, "stop", _as_tuple(self.stop, "stop", "a string or a list of strings"))
        set_(self, "stop_token_ids", _as_tuple(self.stop_token_ids, "stop_token_ids", "a list of token ids"))
        set_(self, "logit_bias", _logit_bias(self.logit_bias))
        _check(_is_finite(self.temperature) and self.temperature >= 0, "temperature",
               f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        _check(_is_finite(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k",
               f"must be -1 or 0 (all tokens) or an integer >= 1, got {self.top_k!r}")
        _check(_is_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p!r}")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
               f"must be an integer >= 1, got {self.max_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_finite(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _check(_is_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               f"must be a finite number > 0 (1 = off), got {self.repetition_penalty!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
               "logprobs", f"must be null or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < MAX_SEED), "seed",
               f"must be null or an integer in [0, 2^63), got {self.seed!r}")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        bad_stop = [s for s in self.stop if not (isinstance(s, str) and s)]
        _check(not bad_stop, "stop", f"stop strings must be non-empty strings, got {bad_stop[:3]!r}")
        bad_ids = [t for t in self.stop_token_ids if not (_is_int(t) and t >= 0)]
        _check(not bad_ids, "stop_token_ids", f"must be non-negative integers, got {bad_ids[:5]!r}")
        for name in ("ignore_eos", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), name, f"must be true or false, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            set_(self, name, float(getattr(self, name)))
        if self.top_k == 0:
            set_(self, "top_k", -1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def is_stop_token(self, token_id: int, eos_token_ids: Sequence[int]) -> bool:
        """Whether `token_id` ends generation: one of stop_token_ids, or an EOS token unless ignore_eos."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_token_ids)

    def fitted_to_context(self, num_prompt_tokens: int, max_model_len: int) -> SamplingParams:
        """These params for a prompt of `num_prompt_tokens`: a server-default `max_tokens` shrunk to what the
        context leaves (as vLLM does); a requested one, or a prompt that leaves nothing, unchanged (the caller's
        context check refuses it)."""
        if self.max_tokens_is_default and num_prompt_tokens < max_model_len < num_prompt_tokens + self.max_tokens:
            return dataclasses.replace(self, max_tokens=max_model_len - num_prompt_tokens)
        return self

    @property
    def has_penalties(self) -> bool:
        """Penalties over the tokens seen so far (the sampler reads the request's history for them)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def modifies_logits(self) -> bool:
        """Whether anything changes the model's logits before the pick: penalties or a logit bias."""
        return self.has_penalties or bool(self.logit_bias)

    @classmethod
    def from_openai(cls, body: dict[str, Any], default_max_tokens: int = 16) -> SamplingParams:
        """Build from an OpenAI /v1/completions or /v1/chat/completions body (plus vLLM's extras).

        max_completion_tokens wins over max_tokens; absent fields take OpenAI's defaults (temperature 1,
        top_p 1). `logprobs` is an int count for completions; for chat it is a flag and `top_logprobs`
        the count (0..20).
        """
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        logprobs = body.get("logprobs")
        top_logprobs = body.get("top_logprobs")
        if isinstance(logprobs, bool):  # chat: logprobs is a flag, top_logprobs the count
            if top_logprobs is not None:
                _check(_is_int(top_logprobs) and 0 <= top_logprobs <= MAX_LOGPROBS, "top_logprobs",
                       f"must be an integer in [0, {MAX_LOGPROBS}], got {top_logprobs!r}")
            _check(logprobs or not top_logprobs, "top_logprobs",
                   f"top_logprobs={top_logprobs} needs logprobs=true")
            logprobs = (top_logprobs or 0) if logprobs else None
        kwargs: dict[str, Any] = {
            "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
            "max_tokens_is_default": max_tokens is None,
            "temperature": 1.0 if body.get("temperature") is None else body["temperature"],
            "top_p": 1.0 if body.get("top_p") is None else body["top_p"],
            "seed": body.get("seed"),
            "logprobs": logprobs,
            "stop": body.get("stop") or (),
        }
        for name in ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty",
                     "ignore_eos", "stop_token_ids", "skip_special_tokens", "logit_bias"):
            if body.get(name) is not None:
                kwargs[name] = body[name]
        return cls(**kwargs)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted (token id, bias) pairs, from a mapping (JSON's keys are strings: "50256") or pairs;
    InvalidSamplingParams naming `logit_bias` for anything else, a negative or non-integer id, or a bias that is
    not a finite number in [-100, 100]."""
    if value is None:
        return ()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        return _fail("logit_bias", f"must be a mapping of token ids to biases, got {value!r:.80}")
    _check(len(items) <= MAX_LOGIT_BIAS_TOKENS, "logit_bias",
           f"at most {MAX_LOGIT_BIAS_TOKENS} token ids are allowed, got {len(items)}")
    pairs: dict[int, float] = {}
    for key, bias in items:
        # ASCII digits only, and few of them: int() refuses other Unicode digits and strings past 4,300 digits
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 else key
        _check(_is_int(token) and token >= 0, "logit_bias",
               f"keys must be token ids (non-negative integers), got {key!r:.40}")
        _check(_is_finite(bias) and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE, "logit_bias",
               f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], got {bias!r:.40} for token {token}")
        _check(token not in pairs, "logit_bias", f"token id {token} is given twice")
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items()))


def _as_tuple(value: Any, field_name: str, expected: str) -> tuple:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if field_name == "stop" else _fail(field_name, f"must be {expected}, got {value!r}")
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return _fail(field_name, f"must be {expected}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fail(field_name: str, message: str) -> Any:
    raise InvalidSamplingParams(field_name, message)


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParams(field_name, message)
