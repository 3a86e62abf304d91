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
