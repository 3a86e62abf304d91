"""A tiled Triton GEMM, and `route_projections` to run a model's projections through it: the kernel of
`benchmarks/gpu/partition_gemm.py`.

Why it was written (docs/policy.md, twenty-seventh and twenty-eighth sections): on a 116-SM green-context partition
of an H200, cuBLAS's kernels for the qkv, o and down projections of a prefill step run 1.74x slower than on the whole
GPU (a grid of 132 CTAs, sized for the device). This kernel launches one program per output tile (or, with
`num_programs`, that many programs looping over the tiles), so the hardware spreads the tiles over whatever SMs the
partition has. Measured (`benchmarks/results/partition_gemm_h200/`): 0.60-0.77x of cuBLAS on the whole GPU and
0.78-0.93x on 116 SMs, on every projection, so the engine does not use it (its `prefill_gemm: triton` was removed).

Written from the textbook tiling: an output tile per program, a K loop with a float32 accumulator, tiles ordered in
groups of GROUP_M rows so neighbouring programs share weight tiles in L2. `TRITON_INTERPRET=1` runs it on CPU (the
tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

from bullet_ray.engine.lt_gemm import PROJECTION_MODULES


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile index -> (row tile, column tile), GROUP_M row tiles sweeping the columns together."""
    per_group = GROUP_M * num_n
    first_m = (tile // per_group) * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    within = tile % per_group
    return first_m + within % rows, within // rows


@triton.jit
def _linear_tile(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn, pid_m, pid_n,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[tile] = x[rows, :] @ w[cols, :]^T, accumulated in float32 over K."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * sxm + offs_k[None, :] * sxk
    w_ptrs = w_ptr + offs_n[None, :] * swn + offs_k[:, None] * swk  # a (BLOCK_K, BLOCK_N) view of w^T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < left), other=0.0)
        b = tl.load(w_ptrs, mask=(offs_n[None, :] < N) & (offs_k[:, None] < left), other=0.0)
        acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * sxk
        w_ptrs += BLOCK_K * swk
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    tl.store(y_ptr + offs_m[:, None] * sym + offs_n[None, :] * syn, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "NUM_PROGRAMS"])  # one compiled kernel for every row count and launch size
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn, NUM_PROGRAMS,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Program p computes tiles p, p + NUM_PROGRAMS, ...: one tile each when launched with one program per tile,
    a persistent loop when launched with fewer."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    for tile in range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        _linear_tile(x_ptr, w_ptr, y_ptr, M, N, K, sxm, sxk, swn, swk, sym, syn, pid_m, pid_n,
                     BLOCK_M, BLOCK_N, BLOCK_K)


# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    "128x256x64s3w8": (128, 256, 64, 3, 8), "128x128x64s4w8": (128, 128, 64, 4, 8),
    "256x128x64s3w8": (256, 128, 64, 3, 8), "128x128x64s4w4": (128, 128, 64, 4, 4),
    "16x32x16s1w1": (16, 32, 16, 1, 1),  # tiny: the CPU interpreter's tests
}
# the projections cuBLAS loses most on a partition (gate_up keeps pace): route_projections' default
NARROW = ("qkv", "o", "down")


def linear(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int],
           num_programs: int | None = None, out: torch.Tensor | None = None, group_m: int = 8) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (into `out` if given); one program per output tile, or
    `num_programs` programs looping over the tiles."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear needs x [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    bm, bn, bk, stages, warps = config
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = tiles if num_programs is None else max(1, min(num_programs, tiles))
    _linear_kernel[(programs,)](x, w, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                                out.stride(0), out.stride(1), programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                GROUP_M=group_m, num_stages=stages, num_warps=warps)
    return out


def _routed(mod: Any, config: tuple[int, int, int, int, int], programs: int | None, x: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """A routed projection: its forward (out None) and its gemm_into (into a CUDA graph's buffer)."""
    return linear(x, mod.weight, config, programs, out=out)


def route_projections(model: Any, config_name: str, projections: tuple[str, ...] = NARROW,
                      num_programs: int | None = None) -> Callable[[], None]:
    """Send every decoder layer's `projections` of `model` (a bullet_ray.models.llama model) through `linear` with
    tile config `config_name` (and `num_programs`: None, one program per tile): each nn.Linear's forward, and its
    `gemm_into` (what `layers.linear_into` calls when a CUDA graph's buffer takes the result). Bias-free
    projections only, each routed once (ValueError otherwise). Returns the undo."""
    if config_name not in CONFIGS:
        raise ValueError(f"unknown tile config {config_name!r}; choose one of {', '.join(CONFIGS)}")
    unknown = [p for p in projections if p not in PROJECTION_MODULES]
    if unknown:
        raise ValueError(f"unknown projections {unknown}; choose from {', '.join(PROJECTION_MODULES)}")
    config = CONFIGS[config_name]
    mods = [getattr(getattr(layer, PROJECTION_MODULES[p][0]), PROJECTION_MODULES[p][1])
            for layer in model.model.layers for p in projections]
    with_bias = [m for m in mods if m.bias is not None]
    if with_bias:
        raise ValueError(f"{len(with_bias)} of the routed projections have a bias; the Triton GEMM has none")
    if any("gemm_into" in m.__dict__ for m in mods):
        raise ValueError(f"projections {projections} are routed already; undo that first")
    for mod in mods:
        mod.forward = mod.gemm_into = functools.partial(_routed, mod, config, num_programs)

    def undo() -> None:
        for mod in mods:
            del mod.forward
            del mod.gemm_into

    return undo
