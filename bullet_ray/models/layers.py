"""Building blocks shared by the decoder families: RMSNorm, rotary embeddings (incl. llama3 scaling),
SiLU-and-multiply. Numerics follow Hugging Face's implementations so float32 outputs match."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bullet_ray.models import gpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: str | torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (fused := gpu_kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return fused
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual): the residual add and the norm, fused in one kernel on GPU
        (which may reuse x's and residual's memory)."""
        if x.is_cuda and (fused := gpu_kernels.add_rms_norm(x, residual, self.weight, self.eps)) is not None:
            return fused
        residual = x + residual
        return self.forward(residual), residual


def linear_into(layer: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """layer(x) written into `out` (a CUDA graph's static buffer): the GEMM writes it, no copy. A projection routed
    to another GEMM (`gemm_into` on the module, e.g. benchmarks/gpu/triton_gemm.route_projections) writes it its way."""
    routed = layer.__dict__.get("gemm_into")
    if routed is not None:
        return routed(x, out)
    weight, bias = layer.weight.t(), layer.bias
    return torch.mm(x, weight, out=out) if bias is None else torch.addmm(bias, x, weight, out=out)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, with gate and up concatenated on the last dimension."""
    if gate_up.is_cuda and (fused := gpu_kernels.silu_and_mul(gate_up)) is not None:
        return fused
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies of the rotary embedding, with llama3 or linear scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type")
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind != "llama3":
        return inv_freq
    factor = float(scaling["factor"])
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding applied at arbitrary positions of a flat batch."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device: str | torch.device) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D], positions: [T]. On CUDA the fused kernel rotates q and k in place."""
        if q.is_cuda and (fused := gpu_kernels.rope_inplace(self, positions, q, k)) is not None:
            return fused
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions.float()[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
