"""Shared pieces of the schedulers: the allocator protocol and the scheduled-sequence record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from bullet_ray.engine.sequence import Sequence


class BlockSource(Protocol):
    """What a scheduler needs of the block allocator."""

    @property
    def num_free(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    def allocate(self, n: int) -> list[int] | None: ...

    def free(self, block_ids: list[int]) -> None: ...


@dataclass
class ScheduledSeq:
    """One sequence of a batch and the number of its uncomputed tokens to run now."""

    seq: Sequence
    num_new_tokens: int

    @property
    def completes_known_tokens(self) -> bool:
        """True when this step computes the last known token, so the step samples the next one."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


def is_decode_only(batch: list[ScheduledSeq]) -> bool:
    """One new token a row: a pure-decode step (the runner's decode graphs, the decode side's pieces); an empty batch
    is one too."""
    return all(item.num_new_tokens == 1 for item in batch)


def blocks_needed(seq: Sequence, num_new_tokens: int, block_size: int) -> int:
    """Blocks to add so that seq can hold num_computed + num_new_tokens tokens."""
    total = (seq.num_computed_tokens + num_new_tokens + block_size - 1) // block_size
    return max(0, total - len(seq.block_ids))


def grow(seq: Sequence, num_new_tokens: int, block_size: int, allocator: BlockSource) -> bool:
    """Give seq the blocks it needs for num_new_tokens more tokens; False (nothing taken) when full."""
    need = blocks_needed(seq, num_new_tokens, block_size)
    if need == 0:
        return True
    ids = allocator.allocate(need)
    if ids is None:
        return False
    seq.block_ids.extend(ids)
    return True


def release(seq: Sequence, allocator: BlockSource) -> None:
    """Free all of seq's blocks and forget its computed KV (preemption, abort, finish)."""
    if seq.block_ids:
        allocator.free(seq.block_ids)
    seq.block_ids = []
    seq.num_computed_tokens = 0
