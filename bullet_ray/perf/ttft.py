"""Predicted time to first token of queued requests, given the prefill batches they will run in and a split.

Batches run one after another on the prefill side's SMs (with the decode side busy or not); a request's
first token comes when its batch finishes:

    finish_k = start + sum_{j <= k} prefill_step(batch_j, prefill_sms, other_busy)
    TTFT_r   = waited_r + finish_{batch of r}

`start` is the time left of the prefill step running now. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence

from bullet_ray.perf.model import PerfModel


def batch_time_s(model: PerfModel, prompt_lens: Sequence[int], sms: int, other_busy: bool,
                 index: int | None = None, cached_lens: Sequence[int] | None = None) -> float:
    """One prefill step over these prompts (exact causal attention pairs)."""
    cached = list(cached_lens) if cached_lens is not None else [0] * len(prompt_lens)
    new = [p - c for p, c in zip(prompt_lens, cached)]
    pairs = sum(n * p - n * (n - 1) // 2 for n, p in zip(new, prompt_lens))  # as StepShape.of_prompts
    return model.predict_prefill_s(sum(new), sum(prompt_lens), sms, other_busy, len(new), index, pairs)


def batches_finish_s(model: PerfModel, batches: Sequence[Sequence[int]], sms: int, other_busy: bool,
                     start_s: float = 0.0, index: int | None = None) -> list[float]:
    """Seconds from now until each batch (a list of prompt lengths) has its first tokens."""
    out, t = [], start_s
    for batch in batches:
        t += batch_time_s(model, batch, sms, other_busy, index)
        out.append(t)
    return out


def predict_queue_ttft_s(model: PerfModel, batches: Sequence[Sequence[tuple[int, float]]], sms: int,
                         other_busy: bool, start_s: float = 0.0, index: int | None = None) -> list[list[float]]:
    """Predicted TTFT of every request: `batches` holds (prompt tokens, seconds already waited) per request,
    in the order the batches will run; the result has the same nesting."""
    finish = batches_finish_s(model, [[n for n, _ in b] for b in batches], sms, other_busy, start_s, index)
    return [[waited + f for _, waited in b] for b, f in zip(batches, finish)]
