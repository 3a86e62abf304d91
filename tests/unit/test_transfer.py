"""Host lists to device tensors: on CPU the plain tensor (the CUDA path is exercised by the GPU tests and
every GPU benchmark through the runner). Flat lists go through a C array; the tensors equal torch.tensor's
and own their memory."""

from __future__ import annotations

import pytest
import torch

from bullet_ray.engine.transfer import to_device


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32, torch.float64, torch.bool])
def test_same_values_as_torch_tensor(dtype):
    values = [0, 1, 5, 2**20, 7] if dtype is not torch.bool else [True, False, True]
    if dtype.is_floating_point:
        values = [0.1, -2.5, 1e-3, 3.0]
    out = to_device(values, dtype, "cpu")
    assert out.dtype == dtype and torch.equal(out, torch.tensor(values, dtype=dtype))


def test_empty_nested_and_non_list_inputs():
    assert to_device([], torch.int64, "cpu").shape == (0,)
    assert torch.equal(to_device([[1, 2], [3, 4]], torch.int32, "cpu"), torch.tensor([[1, 2], [3, 4]], dtype=torch.int32))
    assert torch.equal(to_device((4, 5), torch.int64, "cpu"), torch.tensor([4, 5]))


def test_the_tensor_owns_its_memory():
    values = list(range(1000))
    out = to_device(values, torch.int64, "cpu")
    del values
    import gc

    gc.collect()
    assert out.sum().item() == sum(range(1000)) and out.is_contiguous()
    out[0] = 7  # writable, and no warning about a non-writable buffer
    assert out[0].item() == 7


def test_cpu_values_dtype_and_shape():
    t = to_device([[1, 2], [3, 4]], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert t.tolist() == [[1, 2], [3, 4]]
    assert to_device([], torch.int64, torch.device("cpu")).numel() == 0


def test_step_copy_bytes_is_the_larger_of_a_steps_two_copies():
    from bullet_ray.engine.transfer import step_copy_bytes

    # 2,048 tokens, 64 sequences of up to 1,024 pages: the int64 part (ids, positions, slots; gathers) is larger
    assert step_copy_bytes(2048, 64, 1024) == max((3 * 2048 + 2 * 64) * 8, (2 * 64 + 1 + 64 * 1024) * 4)
    # 16,384 tokens and 1,024 sequences of up to 1,024 pages: the page table dominates
    assert step_copy_bytes(16384, 1024, 1024) == (2 * 1024 + 1 + 1024 * 1024) * 4


def test_warm_pinned_holds_blocks_of_every_power_of_two_up_to_the_largest_copy():
    """Every size class the caching host allocator rounds a step's copies to, from 1 byte to the first power of
    two >= the largest copy (capped), several blocks each."""
    from bullet_ray.engine import transfer

    assert transfer.pinned_bucket_sizes(1) == [1]
    assert transfer.pinned_bucket_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert transfer.pinned_bucket_sizes(1 << 40)[-1] == transfer.MAX_WARM_PINNED_BYTES
    asked: list[int] = []

    def allocate(size: int) -> torch.Tensor:
        asked.append(size)
        return torch.empty(size, dtype=torch.uint8)

    total = transfer.warm_pinned(600_000, allocate)
    sizes = transfer.pinned_bucket_sizes(600_000)
    assert sizes[-1] == 1 << 20 and sorted(set(asked)) == sizes
    for size in sizes:
        want = transfer.PINNED_PER_LARGE_SIZE if size >= transfer.LARGE_PINNED_BYTES else transfer.PINNED_PER_SIZE
        assert asked.count(size) == want
    assert total == sum(asked)


def test_allocator_counts_are_empty_before_cuda_is_initialized():
    from bullet_ray.engine.transfer import allocator_counts

    assert not torch.cuda.is_initialized() and allocator_counts() == {}  # statistics read empty until then
