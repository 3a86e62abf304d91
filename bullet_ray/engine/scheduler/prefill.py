"""The prefill worker's scheduler: FCFS queue, prompts chunked to fit the token budget.

A new sequence is admitted only if its blocks fit while leaving `watermark_blocks` free for running
sequences to grow into; otherwise it waits (never an error). Recomputed (preempted) sequences go to the
front of the queue.

A prompt chunked part-way keeps its blocks while it waits for its next chunk, and nothing else frees them.
Once every block in use is held by this queue (nothing runs, nothing is in flight or in transit: the pool's
free blocks and the queue's add up to all of them), a head that cannot fit would wait forever: `schedule` then
lets the head into the watermark (no running sequence needs it) and releases the KV of the last waiting
sequence behind the head that holds some, one at a time, until the head fits (it is recomputed later, like a
preempted one). A queue whose head fits the pool alone (max_model_len <= the pool) therefore always moves.
"""

from __future__ import annotations

from collections import deque

from bullet_ray.engine.scheduler.base import BlockSource, ScheduledSeq, blocks_needed, grow, release
from bullet_ray.engine.sequence import Sequence


class PrefillScheduler:
    def __init__(self, allocator: BlockSource, block_size: int, max_num_batched_tokens: int,
                 max_num_seqs: int, watermark_blocks: int = 0) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Sequence] = deque()
        self.num_reclaimed = 0  # waiting sequences whose KV was released for the head (module docstring)

    def __len__(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence, front: bool = False) -> None:
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a waiting sequence and free its blocks; None if not here."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                release(seq, self.allocator)
                return seq
        return None

    def schedule(self, max_num_batched_tokens: int | None = None, max_num_seqs: int | None = None) -> list[ScheduledSeq]:
        """Pick the next prefill batch (allocating its blocks), FCFS under the token budget; a budget or batch
        size given here holds for this batch only (a chunked step's: what its decode rows leave). When nothing
        else holds KV, a head that cannot fit takes the watermark and waiting prompts' KV (module docstring)."""
        batch = self._schedule(max_num_batched_tokens, max_num_seqs, self.watermark_blocks)
        if batch or not self.waiting or not self._holds_every_used_block():
            return batch
        batch = self._schedule(max_num_batched_tokens, max_num_seqs, 0)  # no running sequence needs the watermark
        while not batch and self._release_last_partial():
            batch = self._schedule(max_num_batched_tokens, max_num_seqs, 0)
        return batch

    def _holds_every_used_block(self) -> bool:
        """Every block not free belongs to a sequence in this queue: nothing else will free one."""
        held = sum(len(s.block_ids) for s in self.waiting)
        return self.allocator.num_free + held == self.allocator.num_blocks

    def _release_last_partial(self) -> bool:
        """Free the KV of the last waiting sequence behind the head that holds blocks; False if none does."""
        for seq in reversed(list(self.waiting)[1:]):
            if seq.block_ids:
                release(seq, self.allocator)
                self.num_reclaimed += 1
                return True
        return False

    def _schedule(self, max_num_batched_tokens: int | None, max_num_seqs: int | None,
                  watermark_blocks: int) -> list[ScheduledSeq]:
        batch: list[ScheduledSeq] = []
        budget = self.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
        max_seqs = self.max_num_seqs if max_num_seqs is None else max_num_seqs
        for seq in self.waiting:
            if budget <= 0 or len(batch) >= max_seqs:
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            is_new = not seq.block_ids
            reserve = watermark_blocks if is_new else 0
            if self.allocator.num_free - blocks_needed(seq, num_new, self.block_size) < reserve:
                break  # FCFS: do not let later (smaller) requests overtake a waiting one
            if not grow(seq, num_new, self.block_size, self.allocator):
                break
            batch.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return batch

    def remove(self, seqs: list[Sequence]) -> None:
        """Dequeue sequences whose prefill is complete (handed off or finished)."""
        for seq in seqs:
            self.waiting.remove(seq)
