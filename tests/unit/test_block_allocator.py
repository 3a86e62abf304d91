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

