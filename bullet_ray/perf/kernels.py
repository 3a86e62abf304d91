"""FLOPs and bytes of each kernel class of one engine step, from the model's architecture and the batch.

A step (prefill or decode, the same forward) runs per layer: the fused qkv projection, attention, the o
projection, the fused gate/up projection, down; then the lm_head on the rows that sample. For a batch of
T new tokens in S sequences whose KV after the step holds C tokens in all, and A (query, key) pairs attended
(causal), with hidden h, q = heads x head_dim, kv = kv_heads x head_dim, intermediate i, vocab V, b bytes
per element:

    qkv      2 T h (q + 2 kv)      FLOPs;  b (h (q + 2 kv) + T h + T (q + 2 kv))   bytes   (x layers)
    o        2 T q h                        b (q h + T q + T h)
    gate_up  2 T h 2i                       b (2 i h + T h + 2 T i)
    down     2 T i h                        b (i h + T i + T h)
    attention 4 q A                         b (2 kv C + 2 T q + 2 T kv)   (reads K/V, q; writes out, new K/V)
    lm_head  2 S h V                        b (V h + S h) + 4 S V     (float32 logits)

Attention is `attention_prefill` or `attention_decode` by the step's phase (their kernels differ).
Norms, rotary and activations are not counted; the calibration absorbs them. Pure Python.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Literal

from bullet_ray.errors import ConfigError
from bullet_ray.models.config import ModelConfig

Phase = Literal["prefill", "decode"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


class KernelClass(str, enum.Enum):
    QKV = "qkv"
    O_PROJ = "o"
    GATE_UP = "gate_up"
    DOWN = "down"
    ATTENTION_PREFILL = "attention_prefill"
    ATTENTION_DECODE = "attention_decode"
    LM_HEAD = "lm_head"

    @property
    def group(self) -> str:
        """The calibration group: "linear" (weight GEMMs and lm_head) or "attention"."""
        return "attention" if self in (KernelClass.ATTENTION_PREFILL, KernelClass.ATTENTION_DECODE) else "linear"


GROUPS: tuple[str, ...] = ("linear", "attention")


@dataclass(frozen=True)
class Cost:
    flops: float
    num_bytes: float


@dataclass(frozen=True)
class StepShape:
    """One step's batch in the numbers the model needs (all counts >= 0; a step has >= 1 token)."""

    phase: Phase
    num_tokens: int  # new tokens computed this step (T)
    num_seqs: int  # sequences in the batch; each samples one token (S)
    num_context_tokens: int  # KV tokens after the step, summed over sequences (C)
    num_attention_pairs: int  # (query, key) pairs attended, causal, summed over sequences (A)

    @property
    def size(self) -> int:
        """What the online correction keys a step by: its new tokens (prefill) or its batch (decode)."""
        return self.num_tokens if self.phase == "prefill" else self.num_seqs

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise ConfigError("phase", f"unknown phase {self.phase!r}; choose one of {PHASES}")
        if self.num_tokens < 1 or self.num_seqs < 1:
            raise ConfigError("num_tokens", f"a step needs >= 1 token and >= 1 sequence, got "
                              f"{self.num_tokens} tokens in {self.num_seqs} sequences")
        if self.num_context_tokens < self.num_tokens:
            raise ConfigError("num_context_tokens", f"{self.num_context_tokens} is fewer than the step's "
                              f"{self.num_tokens} new tokens")

    @classmethod
    def prefill(cls, num_tokens: int, num_context_tokens: int | None = None, num_seqs: int = 1) -> StepShape:
        """A prefill step of `num_tokens` new tokens in `num_seqs` sequences of about equal length whose KV
        reaches `num_context_tokens` in all (default: no cached prefix). Pairs: each sequence's n new tokens
        over c keys attend n c - n (n - 1) / 2 pairs."""
        ctx = num_tokens if num_context_tokens is None else num_context_tokens
        s = max(1, num_seqs)
        n, c = num_tokens / s, ctx / s
        pairs = round(s * (n * c - n * (n - 1) / 2))
        return cls("prefill", num_tokens, s, ctx, max(pairs, num_tokens))

    @classmethod
    def decode(cls, num_seqs: int, num_context_tokens: int) -> StepShape:
        """A decode step: one new token per sequence, attending its whole context."""
        return cls("decode", num_seqs, num_seqs, max(num_context_tokens, num_seqs), max(num_context_tokens, num_seqs))

    @classmethod
    def of_prompts(cls, prompt_lens: list[int], cached_lens: list[int] | None = None) -> StepShape:
        """The exact prefill shape of a batch of prompts (with optional cached prefixes)."""
        if not prompt_lens:
            raise ConfigError("prompt_lens", "a prefill batch needs at least one prompt")
        cached = cached_lens or [0] * len(prompt_lens)
        new = [p - c for p, c in zip(prompt_lens, cached)]
        pairs = sum(n * p - n * (n - 1) // 2 for n, p in zip(new, prompt_lens))
        return cls("prefill", sum(new), len(new), sum(prompt_lens), pairs)


def projection_shapes(cfg: ModelConfig) -> dict[KernelClass, tuple[int, int]]:
    """(in, out) features of each GEMM of a decoder layer, as the engine fuses them (q, k and v in one; gate and
    up in one)."""
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    return {KernelClass.QKV: (h, q + 2 * kv), KernelClass.O_PROJ: (q, h), KernelClass.GATE_UP: (h, 2 * i),
            KernelClass.DOWN: (i, h)}


def kernel_costs(cfg: ModelConfig, shape: StepShape, dtype_bytes: int = 2) -> dict[KernelClass, Cost]:
    """FLOPs and bytes of each kernel class over the whole step (all layers): a projection of T rows from k to n
    features is 2 T k n FLOPs and reads / writes its weights, its input and its output once."""
    b, L = dtype_bytes, cfg.num_hidden_layers
    h, v, q, kv = cfg.hidden_size, cfg.vocab_size, cfg.q_size, cfg.kv_size
    t, s, c, a = shape.num_tokens, shape.num_seqs, shape.num_context_tokens, shape.num_attention_pairs
    costs = {cls: Cost(L * 2.0 * t * k * n, L * b * (k * n + t * k + t * n))
             for cls, (k, n) in projection_shapes(cfg).items()}
    attention = (KernelClass.ATTENTION_PREFILL if shape.phase == "prefill" else KernelClass.ATTENTION_DECODE)
    costs[attention] = Cost(L * 4.0 * q * a, L * b * (2 * kv * c + 2 * t * q + 2 * t * kv))
    costs[KernelClass.LM_HEAD] = Cost(2.0 * s * h * v, b * (v * h + s * h) + 4.0 * s * v)
    return costs


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name ("bfloat16", "float16", "float32")."""
    sizes = {"bfloat16": 2, "float16": 2, "float32": 4}
    if name not in sizes:
        raise ConfigError("dtype", f"unknown dtype {name!r}; choose one of {sorted(sizes)}")
    return sizes[name]
