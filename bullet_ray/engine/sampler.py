"""Turning logits into tokens: penalties, greedy or temperature/top-k/top-p/min-p sampling, logprobs.

Each request draws its random numbers from its own torch.Generator, so a seeded request yields the same
tokens alone or in any batch, and its generator state travels with it from the prefill process to the
decode process (`SamplingState.to_wire`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from bullet_ray.engine.outputs import TokenLogprob
from bullet_ray.engine.sampling_params import SamplingParams


class SamplingState:
    """Per-request sampling state: parameters, token history for penalties, and the RNG.

    Unseeded requests get a generator seeded from os.urandom, so both kinds take the same code path.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int],
                 output_token_ids: list[int] | None = None, rng_state: bytes | None = None) -> None:
        self.params = params
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids if output_token_ids is not None else []
        self.generator = torch.Generator()
        if rng_state is not None:
            self.generator.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
        else:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.generator.manual_seed(seed)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def to_wire(self) -> dict[str, Any]:
        """Plain data (picklable) that `from_wire` turns back into the same state, RNG included."""
        return {"params": self.params, "prompt_token_ids": list(self.prompt_token_ids),
                "output_token_ids": list(self.output_token_ids),
                "rng_state": self.generator.get_state().numpy().tobytes()}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> SamplingState:
        return cls(wire["params"], list(wire["prompt_token_ids"]), list(wire["output_token_ids"]),
                   wire["rng_state"])


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row of `logits` ([N, vocab], float32) for the matching SamplingState."""

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, states)
        tokens: list[int] = []
        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        greedy = logits[greedy_rows].argmax(dim=-1).tolist() if greedy_rows else []
        greedy_by_row = dict(zip(greedy_rows, greedy))
        for i, state in enumerate(states):
            if i in greedy_by_row:
                tokens.append(int(greedy_by_row[i]))
            else:
                tokens.append(self._sample_row(logits[i], state))
        logprobs: list[TokenLogprob | None] = []
        for i, (state, token) in enumerate(zip(states, tokens)):
            n = state.params.logprobs
            if n is None or raw_logprobs is None:
                logprobs.append(None)
                continue
            row = raw_logprobs[i]
            top: tuple[tuple[int, float], ...] = ()
            if n > 0:
                vals, ids = row.topk(n)
                top = tuple((int(t), float(v)) for t, v in zip(ids.tolist(), vals.tolist()))
            logprobs.append(TokenLogprob(token, float(row[token]), top))
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        if not any(_has_penalty(s.params) for s in states):
            return logits
        logits = logits.clone()
        for i, state in enumerate(states):
            p = state.params
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(state.prompt_token_ids) | set(state.output_token_ids)), dtype=torch.long,
                                    device=logits.device)
                if seen.numel():
                    vals = logits[i, seen]
                    logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and state.output_token_ids:
                ids = torch.tensor(state.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _sample_row(row: torch.Tensor, state: SamplingState) -> int:
        p = state.params
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            cum = sorted_probs.cumsum(0)
            drop = cum - sorted_probs >= p.top_p  # keep the smallest prefix whose mass reaches top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        probs = probs / probs.sum()
        return int(torch.multinomial(probs.cpu(), 1, generator=state.generator).item())


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
