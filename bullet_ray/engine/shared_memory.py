"""One contiguous buffer that two processes map: the weights, the KV pool and small state blocks live in these.

On CPU an arena is a file in /dev/shm (or the runtime folder) mapped MAP_SHARED by every process that
attaches; on GPU it is one CUDA allocation exported through a CUDA IPC handle (torch's reductions).
Either way the exporter hands out an `ArenaHandle` (picklable) and the other process calls
`TensorArena.attach(handle)`; tensors are then views at fixed byte offsets, so both sides see the same
memory and nothing is copied.

Ownership: the creating process unlinks the backing file on `close()`; attached processes only unmap.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

_ALIGN_BYTES = 256


@dataclass(frozen=True)
class ArenaHandle:
    """What another process needs to map an arena."""

    nbytes: int
    device: str
    # CPU: the backing file; GPU: None
    path: str | None = None
    # GPU: torch's rebuild function and args for the CUDA IPC handle of the byte tensor
    cuda_ipc: Any = None


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives inside an arena."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def align_up(n: int, align: int = _ALIGN_BYTES) -> int:
    return (n + align - 1) // align * align


class TensorArena:
    """A shared byte buffer and a bump allocator of typed views into it."""

    def __init__(self, buffer: torch.Tensor, handle: ArenaHandle, is_owner: bool) -> None:
        self.buffer = buffer  # uint8 [nbytes]
        self.handle = handle
        self.is_owner = is_owner
        self._next = 0

    @classmethod
    def create(cls, nbytes: int, device: str, path: str | None = None) -> TensorArena:
        """Allocate a new arena of `nbytes` on `device`; CPU arenas need a backing file `path`."""
        nbytes = max(align_up(nbytes), _ALIGN_BYTES)
        if device == "cpu":
            if path is None:
                raise ValueError("a CPU arena needs a backing file path")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, nbytes)
            finally:
                os.close(fd)
            buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            return cls(buffer, ArenaHandle(nbytes=nbytes, device="cpu", path=path), is_owner=True)
        from torch.multiprocessing.reductions import reduce_tensor

        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        rebuild, args = reduce_tensor(buffer)
        return cls(buffer, ArenaHandle(nbytes=nbytes, device=str(buffer.device), cuda_ipc=(rebuild, args)),
                   is_owner=True)

    @classmethod
    def attach(cls, handle: ArenaHandle) -> TensorArena:
        """Map an arena created by another process."""
        if handle.device == "cpu":
            assert handle.path is not None
            buffer = torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
        else:
            rebuild, args = handle.cuda_ipc
            buffer = rebuild(*args)
        return cls(buffer, handle, is_owner=False)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, TensorSpec]:
        """Carve the next aligned tensor out of the arena."""
        spec = TensorSpec(offset=self._next, shape=tuple(shape), dtype=dtype)
        end = spec.offset + spec.nbytes
        if end > self.handle.nbytes:
            raise MemoryError(f"arena of {self.handle.nbytes} bytes is full (asked up to byte {end})")
        self._next = align_up(end)
        return self.view(spec), spec

    def view(self, spec: TensorSpec) -> torch.Tensor:
        """The tensor described by `spec`, a view into this arena."""
        raw = self.buffer[spec.offset:spec.offset + spec.nbytes]
        return raw.view(spec.dtype).view(spec.shape)

    def close(self) -> None:
        """Drop the mapping; the owner also removes the backing file."""
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self.is_owner and self.handle.path is not None:
            try:
                os.unlink(self.handle.path)
            except FileNotFoundError:
                pass
