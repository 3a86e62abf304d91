"""Host lists to device tensors without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream, so every
such call in a step's setup stalls the host until the GPU has finished what was queued before it. Here a
CUDA copy goes through pinned memory with `non_blocking=True`: the host goes on at once, the copy runs in
stream order, and PyTorch's caching host allocator keeps the pinned block until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype,
              device: torch.device | str) -> torch.Tensor:
    """`values` as a tensor on `device`; on CUDA an asynchronous copy from pinned memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
