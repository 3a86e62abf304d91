"""The chunked-prefill baseline (vLLM / SGLang default): one hybrid batch per step under a token budget.

Every running sequence decodes one token first; the remaining budget is filled with prompt chunks from
the waiting queue (FCFS). A preempted sequence goes back to the front of the waiting queue and is
recomputed; nothing leaves this scheduler until it finishes or is aborted.
"""

from __future__ import annotations

from bullet_ray.engine.scheduler.base import BlockSource, ScheduledSeq
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence


class ChunkedScheduler:
    def __init__(self, allocator: BlockSource, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, watermark_blocks: int = 0) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.decode = DecodeScheduler(allocator, block_size, max_num_seqs)
        self.prefill = PrefillScheduler(allocator, block_size, max_num_batched_tokens, max_num_seqs,
                                        watermark_blocks)

    @property
    def num_preemptions(self) -> int:
        """Sequences sent back for recompute: running ones preempted, and waiting ones whose KV was released."""
        return self.decode.num_preemptions + self.prefill.num_reclaimed

    @property
    def num_waiting(self) -> int:
        return len(self.prefill)

    @property
    def num_running(self) -> int:
        return len(self.decode)

    def add(self, seq: Sequence, front: bool = False) -> None:
        self.prefill.add(seq, front=front)

    def abort(self, request_id: str) -> Sequence | None:
        return self.prefill.abort(request_id) or self.decode.abort(request_id)

    def schedule(self) -> list[ScheduledSeq]:
        decodes, preempted = self.decode.schedule()
        for seq in reversed(preempted):
            self.prefill.add(seq, front=True)
        return decodes + prompt_chunks(self.prefill, len(decodes), self.max_num_batched_tokens, self.max_num_seqs)

    def after_step(self, sampled: list[Sequence]) -> None:
        """Move sequences that finished their prefill (they sample a token) to the running set; called
        right after the step's launch, so the next step decodes them."""
        promote(self.prefill, self.decode, sampled)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence, running or (preempted meanwhile) waiting, and free its blocks."""
        if seq in self.prefill.waiting:
            self.prefill.remove([seq])
        self.decode.remove(seq)


def prompt_chunks(prefill: PrefillScheduler, num_decodes: int, max_num_batched_tokens: int,
                  max_num_seqs: int) -> list[ScheduledSeq]:
    """The prompt chunks of a step whose `num_decodes` decode rows come first: FCFS from `prefill`'s queue
    into what they leave of the token budget and the batch size (blocks allocated)."""
    budget = max_num_batched_tokens - num_decodes
    if budget <= 0:
        return []
    return prefill.schedule(budget, max(0, max_num_seqs - num_decodes))


def promote(prefill: PrefillScheduler, decode: DecodeScheduler, sampled: list[Sequence]) -> list[Sequence]:
    """Move the sequences of `sampled` still in `prefill`'s queue (their prompt completed: they sample a
    token) to `decode`'s running set; returns them."""
    waiting = set(id(s) for s in prefill.waiting)
    promoted = [s for s in sampled if id(s) in waiting]
    prefill.remove(promoted)
    for seq in promoted:
        decode.add(seq)
    return promoted
