"""Host-to-device copies on the GPU: after `warm_pinned` at start, a step's copies find free page-locked blocks in
PyTorch's caching host allocator even while the GPU still holds the last ones (their copies queued behind a long
kernel): the allocator does not grow, so no copy synchronizes with the GPU (transfer.py's docstring says why).

Run: python -m pytest tests/gpu/test_transfer_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_warmed_pinned_blocks_serve_copies_in_flight_without_growing():
    from bullet_ray.engine.transfer import allocator_counts, to_device, warm_pinned

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.cuda.init()  # the allocators' statistics read empty until then (a pinned allocation does not initialize)
    warm_pinned(1 << 20)
    if "host_allocs" not in allocator_counts():
        pytest.skip("this torch has no torch.cuda.host_memory_stats")
    before = allocator_counts()["host_allocs"]
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time ahead of every copy below: their blocks stay in use
    out = []
    for _ in range(4):  # up to four copies of one size class in flight, as a step's copies are
        for n in (1, 3, 60, 500, 4000, 30000, 120000):  # 8 bytes to ~1 MB in int64, half in int32
            out.append(to_device(list(range(n)), torch.int64, "cuda"))
            out.append(to_device(list(range(n)), torch.int32, "cuda"))
    assert allocator_counts()["host_allocs"] == before  # taken before the kernel ended: nothing grew
    torch.cuda.synchronize()
    assert all(int(t[-1]) == t.numel() - 1 for t in out)
