"""Host lists to device tensors without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits for the stream, so every
such call in a step's setup stalls the host until the GPU has finished what was queued before it. Here a
CUDA copy goes through pinned memory with `non_blocking=True`: the host goes on at once, the copy runs in
stream order, and PyTorch's caching host allocator keeps the pinned block until the copy has run.

That allocator grows by a new page-locked block (cudaHostAlloc) whenever no cached block of a request's
power-of-two size is free, and a page-locked allocation synchronizes with the GPU: a launch that meets one waits
for the steps in flight, and the GPU then idles while the host prepares the next (the twelfth session's offline
log: 28 launches, `benchmarks/results/offline_h100_m2y/`). `warm_pinned` fills it at start with blocks of every
size a step's copies ask for (`pinned_bucket_sizes`), so that a serving step finds one free.
"""

from __future__ import annotations

import array
import logging
from collections.abc import Callable, Sequence

import torch

# a flat list of Python numbers becomes a C array in one pass (array.array), faster than torch.tensor's
# per-element conversion
_ARRAY_CODES = {torch.int32: "i", torch.int64: "q", torch.float32: "f", torch.float64: "d"}

logger = logging.getLogger(__name__)

# blocks kept per size class: a step asks for a handful (its int64 and int32 inputs, the sampled rows, the sampled
# ids back; sampling with temperature or logprobs and the attention backend ask for more, the small ones often
# of one size) and up to three steps hold theirs (one running, one launched ahead, one being collected); a size
# that still runs short grows once (`allocator_counts` in the step log after a slow launch shows it)
PINNED_PER_SIZE = 8
PINNED_PER_LARGE_SIZE = 4  # from LARGE_PINNED_BYTES: only the biggest steps' inputs come in these sizes
LARGE_PINNED_BYTES = 512 * 1024
MAX_WARM_PINNED_BYTES = 4 * 1024 * 1024  # larger requests (a page table of ~1,000 rows at ~16k tokens) grow it once


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


def step_copy_bytes(max_tokens: int, max_seqs: int, max_blocks_per_seq: int) -> int:
    """The largest host-to-device copy of one step (`ModelRunner.build_metadata`): its int64 part (input ids,
    positions and slots per token, gather indices per sequence) or its int32 part (query and sequence offsets,
    the page table), whichever is larger."""
    longs = (3 * max_tokens + 2 * max_seqs) * 8
    ints = (2 * max_seqs + 1 + max_seqs * max_blocks_per_seq) * 4
    return max(longs, ints)


def pinned_bucket_sizes(max_bytes: int) -> list[int]:
    """Every power-of-two size from 1 byte to the first >= `max_bytes`, capped at MAX_WARM_PINNED_BYTES (the
    caching host allocator rounds each request up to one of these)."""
    top = min(max(1, max_bytes), MAX_WARM_PINNED_BYTES)
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= top:
            return sizes
        size *= 2


def warm_pinned(max_bytes: int, allocate: Callable[[int], torch.Tensor] | None = None) -> int:
    """Make PyTorch's caching host allocator hold free page-locked blocks of every size up to `max_bytes`
    (PINNED_PER_SIZE of each, PINNED_PER_LARGE_SIZE from LARGE_PINNED_BYTES): allocated together, then freed at
    once (never used by a copy, so free without waiting for an event). Returns the bytes it holds; call it on a
    CUDA worker at start. `allocate(size)` stands in for a pinned allocation in tests."""
    if allocate is None:
        def allocate(size: int) -> torch.Tensor:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
    held: list[torch.Tensor] = []
    for size in pinned_bucket_sizes(max_bytes):
        count = PINNED_PER_LARGE_SIZE if size >= LARGE_PINNED_BYTES else PINNED_PER_SIZE
        held.extend(allocate(size) for _ in range(count))
    total = sum(t.numel() * t.element_size() for t in held)
    del held  # back to the allocator's free lists, where the steps' copies find them
    logger.info("pinned host blocks cached at start: %.1f MiB", total / 2**20)
    return total


def allocator_counts() -> dict[str, int]:
    """Blocks the CUDA caching allocators created so far: page-locked host blocks (`host_allocs`) and device
    segments (`device_allocs`, cudaMalloc calls); both synchronize with the GPU. {} where unknown, and before
    CUDA is initialized in this process (PyTorch's statistics read empty until then, a page-locked block
    allocated before then included)."""
    counts: dict[str, int] = {}
    if not torch.cuda.is_initialized():
        return counts
    try:
        counts["host_allocs"] = int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))
    except (AttributeError, RuntimeError):
        pass
    try:
        counts["device_allocs"] = int(torch.cuda.memory_stats().get("num_device_alloc", 0))
    except (AttributeError, RuntimeError):
        pass
    return counts
