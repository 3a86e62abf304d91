"""Host lists to device tensors without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream, so every
such call in a step's setup stalls the host until the GPU has finished what was queued before it. Here a
CUDA copy goes through pinned memory with `non_blocking=True`: the host goes on at once, the copy runs in
stream order, and PyTorch's caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

# a flat list of Python numbers becomes a C array in one pass (array.array), faster than torch.tensor's
# per-element conversion
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f", torch.float64: "d"}


def to_device(values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor on `device`; on CUDA an asynchronous copy from pinned memory."""
    device = torch.device(device)
    host, is_view = _host_tensor(values, dtype)
    if device.type != "cuda":
        # a tensor over the array's memory becomes one that owns its own (the pinned copy below is one)
        return (host.clone() if is_view else host).to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _host_tensor(values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """(a CPU tensor of `values`, whether it is a view of a temporary array's memory)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not values or not isinstance(values, list) or isinstance(values[0], list):
        return torch.tensor(values, dtype=dtype), False
    return torch.frombuffer(array.array(code, values), dtype=dtype), True
