"""The shared KV free list: allocation, exhaustion, double free, and sharing across processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from bullet_ray.engine.block_allocator import AllocatorHandle, BlockAllocator


@pytest.fixture()
def allocator(tmp_path):
    alloc = BlockAllocator.create(8, str(tmp_path / "free_list"))
    yield alloc
    alloc.close()


def test_allocate_until_full_returns_none(allocator):
    first = allocator.allocate(5)
    assert first is not None and len(set(first)) == 5
    assert allocator.num_free == 3
    assert allocator.allocate(4) is None
    assert allocator.num_free == 3  # a failed allocation takes nothing
    rest = allocator.allocate(3)
    assert sorted(first + rest) == list(range(8))
    assert allocator.usage == 1.0


def test_free_returns_blocks_and_rejects_double_free(allocator):
    ids = allocator.allocate(4)
    allocator.free(ids)
    assert allocator.num_free == 8
    with pytest.raises(ValueError, match="not in use"):
        allocator.free(ids[:1])
    got = allocator.allocate(2)
    with pytest.raises(ValueError):
        allocator.free([got[0], got[0]])


def _child_allocates(handle: AllocatorHandle, queue) -> None:
    alloc = BlockAllocator.attach(handle)
    queue.put(alloc.allocate(3))
    alloc.close()


def test_second_process_sees_and_changes_the_same_free_list(allocator):
    mine = allocator.allocate(2)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child_allocates, args=(allocator.export(), queue))
    proc.start()
    theirs = queue.get(timeout=60)
    proc.join(30)
    assert allocator.num_free == 3
    assert not set(mine) & set(theirs)
    allocator.free(theirs)  # blocks taken by one process are freed by the other
    assert allocator.num_free == 6



def test_the_kv_pool_keeps_a_scratch_block_no_sequence_gets(tmp_path):
    """A KVPool's tensor has one block more than its allocator hands out: a decode graph's padding rows write
    there (`scratch_slot`, its first slot), and no allocation ever returns it."""
    import torch

    from bullet_ray.engine.kv_pool import KVPool

    pool = KVPool.create(num_layers=2, num_kv_heads=1, head_dim=4, num_blocks=6, block_size=4, dtype=torch.float32,
                         device="cpu", runtime_dir=str(tmp_path))
    try:
        assert pool.num_blocks == 6 and pool.kv_cache.shape[1] == 7
        assert pool.scratch_slot == 6 * 4
        ids = pool.allocator.allocate(6)
        assert ids is not None and sorted(ids) == list(range(6))  # every block but the scratch one
        assert pool.allocator.allocate(1) is None
        attached = KVPool.attach(pool.export())  # what the second worker maps: the same tensor, the same slot
        try:
            assert attached.kv_cache.shape == pool.kv_cache.shape and attached.scratch_slot == pool.scratch_slot
        finally:
            attached.allocator.close()
    finally:
        pool.close()
