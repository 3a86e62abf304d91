"""Turning logits into tokens: penalties, greedy or temperature/top-k/top-p/min-p sampling, logprobs.

Order of processing, per row of logits:
  1. logit bias (OpenAI's `logit_bias`: added to the model's logits of the listed ids),
  2. repetition penalty (HF semantics) over prompt + output tokens,
  3. presence / frequency penalties (OpenAI semantics) over output tokens,
  4. temperature == 0 (or < 1e-5): greedy argmax (ties -> lowest index, as torch.argmax);
     else logits / temperature -> top-k -> top-p -> min-p -> draw.

Reproducibility: each request draws exactly one float64 uniform per sampled token from its own CPU
torch.Generator and turns it into a token by inverting the CDF of its (masked) distribution; nothing else
random is shared across the batch. So a seeded request yields the same tokens alone or in any batch, and
its generator state travels with it from the prefill process to the decode process
(`SamplingState.to_wire` / `from_wire`). All tensor work is batched over rows (it runs on the logits'
device); only the one-scalar draw per row loops in Python. Masks are value thresholds (see `_draw`), so
ties and batch-mates cannot change a row's kept set.

Logprobs are those of the raw model distribution (log-softmax of the logits before the bias, penalties,
temperature and masks), as vLLM returns by default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bullet_ray.engine.outputs import FinishReason, TokenLogprob
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.transfer import to_device

logger = logging.getLogger(__name__)

__all__ = ["FinishReason", "Sampler", "SamplerOutput", "SamplingState", "TokenLogprob", "is_stop_token"]

# temperatures below this are treated as greedy (dividing by them would overflow the logits)
MIN_TEMPERATURE = 1e-5


def is_stop_token(token_id: int, eos_token_ids: Sequence[int], params: SamplingParams) -> bool:
    """Whether `token_id` ends the request: one of its stop_token_ids, or an EOS token unless ignore_eos."""
    return params.is_stop_token(token_id, eos_token_ids)


class SamplingState:
    """Per-request sampling state: parameters, token history for penalties, and the RNG.

    Seeded requests seed their generator with `params.seed`; unseeded ones from os.urandom, so both take
    the same code path. The state is mutable and owned by one process at a time; it moves by value
    (`to_wire` -> pickle -> `from_wire`) and the copy continues the identical random stream.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int],
                 output_token_ids: list[int] | None = None, rng_state: bytes | None = None) -> None:
        self.params = params  # (its setter also decides `plain_greedy`)
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids = output_token_ids if output_token_ids is not None else []
        self.generator = torch.Generator()  # CPU: its state is portable across processes and devices
        if rng_state is not None:
            self.generator.set_state(torch.frombuffer(bytearray(rng_state), dtype=torch.uint8))
        else:
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.generator.manual_seed(seed)

    @property
    def params(self) -> SamplingParams:
        return self._params

    @params.setter
    def params(self, params: SamplingParams) -> None:
        self._params = params
        # read per row every step (`Sampler.sample_on_device`): decided once per (frozen) parameters, not per step
        self.plain_greedy = _is_plain_greedy(params)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def is_stop_token(self, token_id: int, eos_token_ids: Sequence[int]) -> bool:
        return is_stop_token(token_id, eos_token_ids, self.params)

    def next_uniform(self) -> float:
        """The next draw in [0, 1) of this request's random stream (one per sampled token)."""
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def to_wire(self) -> dict[str, Any]:
        """Picklable data (params, token lists, RNG state bytes) that `from_wire` turns back into this state."""
        return {"params": self.params, "prompt_token_ids": list(self.prompt_token_ids),
                "output_token_ids": list(self.output_token_ids),
                "rng_state": self.generator.get_state().numpy().tobytes()}

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> SamplingState:
        return cls(wire["params"], list(wire["prompt_token_ids"]), list(wire["output_token_ids"]),
                   wire["rng_state"])


@dataclass
class SamplerOutput:
    """One sampled token per input row, and its logprobs where the request asked (else None)."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class DeviceSample:
    """A batch's sampled ids (and logprobs) still on the device; `to_output` reads them (it waits for the
    GPU unless `token_ids_host` was filled once the step's copy had landed)."""

    token_ids: torch.Tensor  # [N] int64 on the device
    logprob_rows: list[int]  # rows that asked for logprobs
    sampled_logprobs: torch.Tensor | None  # [len(logprob_rows)]
    top_values: torch.Tensor | None  # [len(logprob_rows), max top]
    top_ids: torch.Tensor | None
    num_top: list[int]  # top logprobs each of those rows asked for

    def logprobs_to_host(self) -> DeviceSample:
        """The same sample with its logprob tensors copied to pinned host memory without waiting (they are
        valid once the stream has passed this point: the caller records an event after it)."""
        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type != "cuda":
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out

        return DeviceSample(self.token_ids, self.logprob_rows, host(self.sampled_logprobs), host(self.top_values),
                            host(self.top_ids), self.num_top)

    def to_output(self, token_ids_host: list[int] | None = None) -> SamplerOutput:
        token_ids = token_ids_host if token_ids_host is not None else self.token_ids.tolist()
        out: list[TokenLogprob | None] = [None] * len(token_ids)
        if self.sampled_logprobs is not None:
            sampled = self.sampled_logprobs.tolist()
            vals = self.top_values.tolist() if self.top_values is not None else [[] for _ in sampled]
            ids = self.top_ids.tolist() if self.top_ids is not None else [[] for _ in sampled]
            for j, i in enumerate(self.logprob_rows):
                n = self.num_top[j]
                out[i] = TokenLogprob(token_ids[i], sampled[j], tuple(zip(ids[j][:n], vals[j][:n])))
        return SamplerOutput(token_ids, out)


class Sampler:
    """Samples one token per row of `logits` ([N, vocab]) for the matching SamplingState.

    The caller appends the token to the state (`SamplingState.append`); the sampler only reads states and
    advances their generators.
    """

    def sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        return self.sample_on_device(logits, states).to_output()

    def sample_on_device(self, logits: torch.Tensor, states: list[SamplingState]) -> DeviceSample:
        """The sampled ids as a tensor on the logits' device, without waiting for the GPU (greedy rows and
        logprobs never sync; top-p rows sync once to size their sort)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [num_states={len(states)}, vocab], got {tuple(logits.shape)}")
        if all(s.plain_greedy for s in states):
            # argmax in the logits' own dtype: the same index as over their float32 copy (the same values; ties ->
            # the lowest index either way), without writing and reading that copy ([rows, vocab] float32)
            return DeviceSample(logits.argmax(dim=-1), [], None, None, None, [])
        logits = logits.float()
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in states):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._apply_penalties(logits, states)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if s.params.temperature >= MIN_TEMPERATURE]
        if random_rows:
            rows = to_device(random_rows, torch.long, logits.device)
            tokens.index_copy_(0, rows, _draw(logits.index_select(0, rows), [states[i] for i in random_rows]))
        return DeviceSample(tokens, *_logprob_tensors(raw_logprobs, tokens, states))

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Logits after the logit bias and the repetition / presence / frequency penalties (a new tensor; the
        input is kept)."""
        bias_rows = [i for i, s in enumerate(states) if s.params.logit_bias]
        rep_rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
        freq_rows = [i for i, s in enumerate(states)
                     if (s.params.presence_penalty or s.params.frequency_penalty) and s.output_token_ids]
        if not bias_rows and not rep_rows and not freq_rows:
            return logits
        logits = logits.clone()
        num_rows, vocab = logits.shape
        device = logits.device
        if bias_rows:  # through pinned memory without waiting (async scheduling keeps launching ahead)
            pairs = [(i, t, b) for i in bias_rows for t, b in states[i].params.logit_bias]
            rows = to_device([i for i, _, _ in pairs], torch.long, device)
            cols = to_device([t for _, t, _ in pairs], torch.long, device)
            logits.index_put_((rows, cols), to_device([b for _, _, b in pairs], logits.dtype, device), accumulate=True)
        if rep_rows:
            seen = torch.zeros(num_rows, vocab, dtype=torch.bool)
            rows, cols = _row_col([(i, states[i].prompt_token_ids + states[i].output_token_ids) for i in rep_rows])
            seen[rows, cols] = True
            penalty = torch.ones(num_rows, 1)
            penalty[rep_rows, 0] = torch.tensor([states[i].params.repetition_penalty for i in rep_rows])
            seen, penalty = seen.to(device), penalty.to(device)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, penalized, logits)
        if freq_rows:
            counts = torch.zeros(num_rows, vocab)
            rows, cols = _row_col([(i, states[i].output_token_ids) for i in freq_rows])
            counts.index_put_((rows, cols), torch.ones(len(rows)), accumulate=True)
            freq = torch.zeros(num_rows, 1)
            pres = torch.zeros(num_rows, 1)
            freq[freq_rows, 0] = torch.tensor([states[i].params.frequency_penalty for i in freq_rows])
            pres[freq_rows, 0] = torch.tensor([states[i].params.presence_penalty for i in freq_rows])
            counts, freq, pres = counts.to(device), freq.to(device), pres.to(device)
            logits = logits - freq * counts - pres * (counts > 0).to(logits.dtype)
        return logits


def _is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy without logprobs, penalties or a logit bias: the argmax of the raw logits decides the token."""
    return p.temperature < MIN_TEMPERATURE and p.logprobs is None and not p.modifies_logits


def _row_col(pairs: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors (row, token id) for every token of every listed row."""
    rows = [i for i, ids in pairs for _ in ids]
    cols = [t for _, ids in pairs for t in ids]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


def _draw(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Temperature -> top-k -> top-p -> min-p, then one inverse-CDF draw per row from its own generator.

    Every mask is a threshold on the row's own values, so the kept set does not depend on how ties are
    ordered or on what else is in the batch: top-k keeps the logits >= the k-th largest (tokens tied with
    it included, as HF's TopKLogitsWarper), top-p the probabilities >= that of the last token of the
    smallest most-likely-first prefix whose mass reaches top_p, min-p those >= min_p x the largest. The
    draw then walks the CDF in vocabulary order.
    """
    device = logits.device
    params = [s.params for s in states]
    vocab = logits.shape[1]
    temperature = to_device([p.temperature for p in params], torch.float32, device).unsqueeze(1)
    logits = logits / temperature
    top_k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k_rows:
        k_list = [params[i].top_k for i in top_k_rows]
        ks = to_device(k_list, torch.long, device).unsqueeze(1)
        index = to_device(top_k_rows, torch.long, device)
        rows = logits.index_select(0, index)
        kth = rows.topk(max(k_list), dim=-1).values.gather(1, ks - 1)
        logits.index_copy_(0, index, rows.masked_fill(rows < kth, float("-inf")))
    probs = torch.softmax(logits, dim=-1)
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        top_p = to_device([params[i].top_p for i in top_p_rows], torch.float32, device).unsqueeze(1)
        index = to_device(top_p_rows, torch.long, device)
        rows = probs.index_select(0, index)
        # most likely first; only the nonzero probabilities matter (after top-k often few: no full sort)
        num_nonzero = int((rows > 0).sum(dim=-1).max())
        ordered = rows.topk(num_nonzero, dim=-1).values if num_nonzero < vocab // 2 else \
            rows.sort(dim=-1, descending=True).values
        mass_before = ordered.cumsum(dim=-1) - ordered
        num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True).clamp(min=1)
        threshold = ordered.gather(1, num_kept - 1)
        probs.index_copy_(0, index, rows.masked_fill((rows < threshold) | (rows <= 0), 0.0))
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, device).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    uniforms = to_device([s.next_uniform() for s in states], torch.float64, device)
    cdf = probs.cumsum(dim=-1)  # non-decreasing; a token with probability 0 adds no step
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, uniforms.unsqueeze(1).to(cdf.dtype) * total, right=True)
    # u x total may round up to total: then take the last token that moves the CDF
    last = torch.searchsorted(cdf, total, right=False)
    return torch.minimum(picked, last).squeeze(1)


def _logprob_tensors(raw_logprobs: torch.Tensor | None, tokens: torch.Tensor, states: list[SamplingState]
                     ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[int]]:
    """For the rows that asked for logprobs: the sampled token's logprob and the top ones, on the device."""
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if raw_logprobs is None or not rows:
        return [], None, None, None, []
    index = to_device(rows, torch.long, raw_logprobs.device)
    selected = raw_logprobs.index_select(0, index)
    sampled = selected.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
    num_top = [states[i].params.logprobs or 0 for i in rows]
    top_vals = top_ids = None
    if max(num_top) > 0:
        top_vals, top_ids = selected.topk(min(max(num_top), selected.shape[1]), dim=-1)
    return rows, sampled, top_vals, top_ids, num_top
