"""Host lists to device tensors: on CPU the plain tensor (the CUDA path is exercised by the GPU tests and
every GPU benchmark through the runner)."""

from __future__ import annotations

import torch

from bullet_ray.engine.transfer import to_device


def test_cpu_values_dtype_and_shape():
    t = to_device([[1, 2], [3, 4]], torch.int32, "cpu")
    assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert t.tolist() == [[1, 2], [3, 4]]
    assert to_device([], torch.int64, torch.device("cpu")).numel() == 0
