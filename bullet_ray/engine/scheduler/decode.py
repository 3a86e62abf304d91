"""The decode worker's scheduler: every running sequence advances one token per step.

When a sequence needs a new block and none is free, the youngest running sequence is preempted (its
blocks freed, returned to the caller for recompute), repeating until the older one fits. A pool that
holds at least one sequence of max_model_len (checked at admission) therefore always makes progress.
With asynchronous scheduling a sequence whose pending token reaches its length limit is skipped: the
worker drops it once the token is known.
"""

from __future__ import annotations

from bullet_ray.engine.scheduler.base import BlockSource, ScheduledSeq, grow, release
from bullet_ray.engine.sequence import Sequence


class DecodeScheduler:
    def __init__(self, allocator: BlockSource, block_size: int, max_num_seqs: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.running: list[Sequence] = []  # oldest first
        self.num_preemptions = 0

    def __len__(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.running.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                release(seq, self.allocator)
                return seq
        return None

    def remove(self, seq: Sequence) -> None:
        """Drop a finished sequence and free its blocks (one preempted meanwhile is no longer here)."""
        if seq in self.running:
            self.running.remove(seq)
        release(seq, self.allocator)

    def schedule(self) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """The next decode batch, and the sequences preempted to make room (blocks already freed)."""
        batch: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running) and len(batch) < self.max_num_seqs:
            seq = self.running[i]
            if seq.is_length_capped:  # its pending token ends it: nothing more to compute
                i += 1
                continue
            if grow(seq, 1, self.block_size, self.allocator):
                batch.append(ScheduledSeq(seq, seq.num_uncomputed_tokens))
                i += 1
                continue
            victim = self.running[-1]  # the youngest; never one already in the batch
            self._preempt(victim)
            preempted.append(victim)
        return batch, preempted

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        release(seq, self.allocator)
        self.num_preemptions += 1
