"""One copy of the model weights for two processes: move them into a shared arena, or attach to one.

`allocate_shared_weights` gives a model built on the "meta" device storage in a new `TensorArena` (the
weights are then loaded straight into it); `share_weights` does the same for an already loaded model
(copying it). `attach_weights` binds a meta-device model in another process to the same views.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from bullet_ray.engine.shared_memory import ArenaHandle, TensorArena, TensorSpec, align_up


@dataclass(frozen=True)
class WeightsHandle:
    arena: ArenaHandle
    # dotted name -> where it lives; parameters and buffers alike
    tensors: dict[str, TensorSpec]
    num_bytes: int


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    found: list[tuple[str, torch.Tensor, bool]] = [
        (name, p, True) for name, p in model.named_parameters(remove_duplicate=False)]
    found += [(name, b, False) for name, b in model.named_buffers(remove_duplicate=False)]
    return found


def _set_tensor(model: nn.Module, dotted: str, value: torch.Tensor, is_param: bool) -> None:
    owner_name, _, attr = dotted.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if is_param:
        setattr(owner, attr, nn.Parameter(value, requires_grad=False))
    else:
        owner._buffers[attr] = value


def share_weights(model: nn.Module, device: str, runtime_dir: str) -> tuple[TensorArena, WeightsHandle]:
    """Move a loaded model's tensors into a new shared arena. Tied tensors stay tied (stored once)."""
    return allocate_shared_weights(model, device, runtime_dir)


def allocate_shared_weights(model: nn.Module, device: str, runtime_dir: str) -> tuple[TensorArena, WeightsHandle]:
    """Give a meta-device model shared storage: parameters uninitialized, buffers copied in.

    Load the weights afterwards (straight into shared memory: no private copy ever exists).
    """
    tensors = _named_tensors(model)
    unique: dict[int, torch.Tensor] = {}
    for _, t, _ in tensors:
        unique.setdefault(id(t), t)
    nbytes = sum(align_up(t.numel() * t.element_size()) for t in unique.values())
    arena = TensorArena.create(nbytes + 256, device, os.path.join(runtime_dir, "weights"))
    placed: dict[int, tuple[torch.Tensor, TensorSpec]] = {}
    specs: dict[str, TensorSpec] = {}
    for name, t, is_param in tensors:
        if id(t) not in placed:
            view, spec = arena.allocate(tuple(t.shape), t.dtype)
            if not t.is_meta:
                view.copy_(t.detach())
            placed[id(t)] = (view, spec)
        view, spec = placed[id(t)]
        specs[name] = spec
        _set_tensor(model, name, view, is_param)
    return arena, WeightsHandle(arena.handle, specs, nbytes)


def attach_weights(model: nn.Module, handle: WeightsHandle) -> TensorArena:
    """Bind a meta-device model's tensors to the views of an arena created by another process."""
    arena = TensorArena.attach(handle.arena)
    tensors = _named_tensors(model)
    missing = [name for name, _, _ in tensors if name not in handle.tensors]
    if missing:
        raise RuntimeError(f"shared weights lack {missing[:5]} (model definitions differ between processes)")
    for name, _, is_param in tensors:
        _set_tensor(model, name, arena.view(handle.tensors[name]), is_param)
    return arena
