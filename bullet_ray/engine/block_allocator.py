"""The KV block free list, kept in shared host memory so the prefill and decode processes both use it.

Rules:
- `allocate(n)` returns n block ids or None when fewer than n are free: it never raises for a full pool,
  the caller decides (wait, or preempt a sequence).
- Whoever holds a sequence frees its blocks: the prefill side until it hands the sequence over, the
  decode side afterwards. Freeing a block that is not in use raises (a bookkeeping bug, never user input).
- Every operation takes an advisory file lock, so the two processes never interleave on the list.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from bullet_ray.engine.shared_memory import ArenaHandle, TensorArena, TensorSpec

_NUM_FREE, _NUM_BLOCKS, _NUM_ALLOCS = 0, 1, 2


@dataclass(frozen=True)
class AllocatorHandle:
    """What the second process needs to attach to the same free list."""

    arena: ArenaHandle
    header: TensorSpec
    stack: TensorSpec
    in_use: TensorSpec
    lock_path: str


class BlockAllocator:
    """A LIFO stack of free block ids plus an in-use bitmap, in a shared arena."""

    def __init__(self, arena: TensorArena, header: TensorSpec, stack: TensorSpec, in_use: TensorSpec,
                 lock_path: str) -> None:
        self._arena = arena
        self._header_spec, self._stack_spec, self._in_use_spec = header, stack, in_use
        self._header = arena.view(header).numpy()
        self._stack = arena.view(stack).numpy()
        self._in_use = arena.view(in_use).numpy()
        self._lock_path = lock_path
        self._lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    @classmethod
    def create(cls, num_blocks: int, path: str) -> BlockAllocator:
        """A new allocator with every block free; `path` names its backing file (lock: path + '.lock')."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        nbytes = 8 * 4 + 4 * num_blocks + num_blocks + 3 * 256
        arena = TensorArena.create(nbytes, "cpu", path)
        _, header = arena.allocate((4,), torch.int64)
        _, stack = arena.allocate((num_blocks,), torch.int32)
        _, in_use = arena.allocate((num_blocks,), torch.uint8)
        allocator = cls(arena, header, stack, in_use, path + ".lock")
        # block 0 is handed out last, so small tests see high ids first; order is not part of the contract
        allocator._stack[:] = np.arange(num_blocks, dtype=np.int32)
        allocator._header[_NUM_BLOCKS] = num_blocks
        allocator._header[_NUM_FREE] = num_blocks
        return allocator

    @classmethod
    def attach(cls, handle: AllocatorHandle) -> BlockAllocator:
        return cls(TensorArena.attach(handle.arena), handle.header, handle.stack, handle.in_use,
                   handle.lock_path)

    def export(self) -> AllocatorHandle:
        return AllocatorHandle(self._arena.handle, self._header_spec, self._stack_spec, self._in_use_spec,
                               self._lock_path)

    @property
    def num_blocks(self) -> int:
        return int(self._header[_NUM_BLOCKS])

    @property
    def num_free(self) -> int:
        return int(self._header[_NUM_FREE])

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """Take n blocks; None (and nothing taken) when fewer than n are free."""
        if n == 0:
            return []
        with _Locked(self._lock_fd):
            free = int(self._header[_NUM_FREE])
            if n > free:
                return None
            ids = self._stack[free - n:free].copy()
            self._header[_NUM_FREE] = free - n
            self._in_use[ids] = 1
            self._header[_NUM_ALLOCS] += n
        return ids.tolist()

    def free(self, block_ids: Iterable[int]) -> None:
        """Return blocks to the pool. Raises ValueError on a block that is not in use."""
        ids = np.fromiter(block_ids, dtype=np.int32)
        if ids.size == 0:
            return
        with _Locked(self._lock_fd):
            if not self._in_use[ids].all() or np.unique(ids).size != ids.size:
                bad = [int(i) for i in ids if not self._in_use[i]]
                raise ValueError(f"freeing KV blocks that are not in use: {bad or 'duplicates'}")
            free = int(self._header[_NUM_FREE])
            self._stack[free:free + ids.size] = ids
            self._in_use[ids] = 0
            self._header[_NUM_FREE] = free + ids.size

    def close(self) -> None:
        os.close(self._lock_fd)
        if self._arena.is_owner:
            try:
                os.unlink(self._lock_path)
            except FileNotFoundError:
                pass
        self._arena.close()


class _Locked:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
