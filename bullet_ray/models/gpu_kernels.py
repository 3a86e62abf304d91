"""Fused GPU kernels for the model layers (flashinfer): RMSNorm, SiLU-and-multiply and rotary embedding.

On CUDA tensors the layers call these instead of their unfused PyTorch code: a decode step of an 8B model
is ~1,500 small kernels unfused (RMSNorm alone is 8 per call, the rotary embedding ~17 per layer), and
each costs microseconds even inside a CUDA graph. Every function here returns None when it cannot serve
the input (no flashinfer, CPU tensor, an unsupported shape or dtype), and the caller then runs its own
PyTorch code, so CPU numerics never change.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

import torch

logger = logging.getLogger(__name__)

# flashinfer's CuTe-DSL norm kernels need nvidia-cutlass-dsl; its CUDA JIT kernels need nothing more
os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")

_FUSED_DTYPES = (torch.bfloat16, torch.float16)
# programmatic dependent launch (sm90): None = flashinfer's default (on), BULLET_RAY_DISABLE_PDL=1 turns it off
PDL: bool | None = False if os.environ.get("BULLET_RAY_DISABLE_PDL") == "1" else None


@functools.cache
def _flashinfer() -> Any:
    if os.environ.get("BULLET_RAY_DISABLE_FUSED_KERNELS") == "1":
        return None
    try:
        import flashinfer
    except Exception:  # noqa: BLE001 - not installed or no CUDA: the PyTorch path serves
        return None
    return flashinfer


def is_available(x: torch.Tensor) -> bool:
    """Whether fused kernels serve this tensor (CUDA, half precision, flashinfer importable)."""
    return x.is_cuda and x.dtype in _FUSED_DTYPES and _flashinfer() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of the last dimension in one kernel (float32 inside); None when not served (3D or strided)."""
    if not is_available(x) or x.dim() != 2 or not x.is_contiguous() or weight.dtype != x.dtype:
        return None
    return _flashinfer().norm.rmsnorm(x, weight, eps, enable_pdl=PDL)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """residual += x, then x = RMSNorm(residual), both in place in one kernel; returns (x, residual)."""
    if (not is_available(x) or x.dim() != 2 or not x.is_contiguous() or not residual.is_contiguous()
            or residual.shape != x.shape or residual.dtype != x.dtype or weight.dtype != x.dtype):
        return None
    _flashinfer().norm.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=PDL)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up with gate and up concatenated on the last dimension, in one kernel."""
    if not is_available(gate_up) or not gate_up.is_contiguous():
        return None
    return _flashinfer().activation.silu_and_mul(gate_up, enable_pdl=PDL)


def rope_inplace(module: torch.nn.Module, positions: torch.Tensor, q: torch.Tensor,
                 k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Neox rotary embedding of q [T, H, D] and k [T, KVH, D] in place, in one kernel.

    cos/sin come from a float32 table [max_positions, D] built once per module from the module's own
    `inv_freq` (so llama3/linear scaling is whatever the module computed), on the tensors' device.
    """
    if not is_available(q) or q.dim() != 3 or k.dim() != 3 or q.stride(-1) != 1 or k.stride(-1) != 1:
        return None
    head_dim = q.shape[-1]
    if q.stride(1) != head_dim or k.stride(1) != head_dim:  # heads must be back to back within a token
        return None
    cache = _cos_sin_cache(module, q.device)
    q2 = q.view(q.shape[0], -1) if q.is_contiguous() else q.as_strided((q.shape[0], q.shape[1] * head_dim),
                                                                     (q.stride(0), 1))
    k2 = k.view(k.shape[0], -1) if k.is_contiguous() else k.as_strided((k.shape[0], k.shape[1] * head_dim),
                                                                     (k.stride(0), 1))
    _flashinfer().rope.apply_rope_with_cos_sin_cache_inplace(positions, q2, k2, head_dim, cache, is_neox=True)
    return q, k


def _cos_sin_cache(module: torch.nn.Module, device: torch.device) -> torch.Tensor:
    cache = getattr(module, "_fused_cos_sin_cache", None)
    if cache is not None and cache.device == device:
        return cache
    buffer = module.inv_freq
    assert isinstance(buffer, torch.Tensor)
    inv_freq = buffer.float().to(device)
    max_positions = int(getattr(module, "max_positions", 0) or 0) or 131072
    t = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = t[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()
    module._fused_cos_sin_cache = cache  # built outside graph capture: the first (warm-up) call builds it
    return cache
