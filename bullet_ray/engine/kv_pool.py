"""The paged KV pool: one tensor of KV blocks for every layer, plus the shared free list of blocks.

Layout: kv_cache[layer] = [num_blocks + 1, 2, block_size, num_kv_heads, head_dim] (see attention/base.py).
The pool lives in a `TensorArena`, so the prefill and decode workers map the same memory (shared memory
on CPU, CUDA IPC on GPU); the `BlockAllocator` lives in shared host memory beside it. One block past the
allocator's (`KVPool.scratch_slot`) is never handed out: a decode CUDA graph's padding rows write their K/V
there (bullet_ray.engine.cuda_graphs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from bullet_ray.engine.block_allocator import AllocatorHandle, BlockAllocator
from bullet_ray.engine.shared_memory import ArenaHandle, TensorArena, TensorSpec


@dataclass(frozen=True)
class KVPoolHandle:
    arena: ArenaHandle
    cache: TensorSpec
    block_size: int
    allocator: AllocatorHandle


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element


# blocks of the pool past the allocator's: the scratch block (`KVPool.scratch_slot`)
SCRATCH_BLOCKS = 1


class KVPool:
    """The KV tensor and its allocator, created by one worker and attached by the other."""

    def __init__(self, arena: TensorArena, cache_spec: TensorSpec, block_size: int,
                 allocator: BlockAllocator) -> None:
        self._arena = arena
        self._cache_spec = cache_spec
        self.kv_cache = arena.view(cache_spec)
        self.block_size = block_size
        self.allocator = allocator

    @classmethod
    def create(cls, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
               dtype: torch.dtype, device: str, runtime_dir: str) -> KVPool:
        shape = (num_layers, num_blocks + SCRATCH_BLOCKS, 2, block_size, num_kv_heads, head_dim)
        nbytes = kv_bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, dtype) * (num_blocks + SCRATCH_BLOCKS)
        arena = TensorArena.create(nbytes + 512, device, os.path.join(runtime_dir, "kv_pool"))
        cache, spec = arena.allocate(shape, dtype)
        cache.zero_()
        allocator = BlockAllocator.create(num_blocks, os.path.join(runtime_dir, "kv_free_list"))
        return cls(arena, spec, block_size, allocator)

    @classmethod
    def attach(cls, handle: KVPoolHandle) -> KVPool:
        return cls(TensorArena.attach(handle.arena), handle.cache, handle.block_size,
                   BlockAllocator.attach(handle.allocator))

    def export(self) -> KVPoolHandle:
        return KVPoolHandle(self._arena.handle, self._cache_spec, self.block_size, self.allocator.export())

    @property
    def num_blocks(self) -> int:
        """Blocks the allocator hands out (the scratch block not counted)."""
        return self.allocator.num_blocks

    @property
    def scratch_slot(self) -> int:
        """The first slot of the block past the allocator's: written by nobody's sequence, read by no plan."""
        return self.allocator.num_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size

    def close(self) -> None:
        self.allocator.close()
        self._arena.close()
