"""Prefill batches: the most urgent request first, then requests of similar length, up to where the
step's arithmetic intensity has saturated.

Past `saturation_tokens` (bullet_ray.perf.model.PerfModel.saturation_tokens: the fewest tokens whose
throughput is within a few percent of the best) a bigger batch gains nothing and delays its first
requests, so a batch stops there (and at the engine's token cap). Members come from the head's length
bucket first, then from the nearest buckets; a request joins only if the head still meets its target
with it (`fits`). A prompt longer than the cap runs alone (the engine chunks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bullet_ray.policy.buckets import LengthBuckets
from bullet_ray.policy.state import QueuedRequest


def plan_batches(order: Sequence[QueuedRequest], buckets: LengthBuckets, token_cap: int, saturation_tokens: int,
                 fits: Callable[[list[QueuedRequest]], bool] | None = None,
                 max_batches: int | None = None) -> list[list[QueuedRequest]]:
    """The queue cut into batches, in the order they run (the first `max_batches` only, if given)."""
    limit = max(1, min(token_cap, saturation_tokens))
    remaining = list(order)
    batches: list[list[QueuedRequest]] = []
    while remaining and (max_batches is None or len(batches) < max_batches):
        head = remaining.pop(0)
        batch, tokens = [head], head.num_remaining_tokens
        home = buckets.bucket_of(head.num_prompt_tokens)
        if tokens < limit:
            by_distance = sorted(remaining, key=lambda r: abs(buckets.bucket_of(r.num_prompt_tokens) - home))
            for r in by_distance:
                if tokens + r.num_remaining_tokens > limit:
                    continue
                if fits is not None and not fits(batch + [r]):
                    continue
                batch.append(r)
                tokens += r.num_remaining_tokens
                if tokens >= limit:
                    break
            taken = {r.request_id for r in batch}
            remaining = [r for r in remaining if r.request_id not in taken]
        batches.append(batch)
    return batches
