"""Decode-shaped GEMMs of Llama-3.1-8B on the GPU, one implementation against another: which kernel reads a
layer's weights fastest at a decode batch of M rows. Each (projection, M, method) is timed as a CUDA graph of
the GEMM over NUM_COPIES weight copies (past L2), replayed back to back; GB/s counts the weight bytes.

Methods: `linear` (torch.mm(x, W.t()), the GEMM F.linear runs), `wt` (weights stored transposed, x @ W^T as torch.mm on a
[K, N] copy), `cublaslt` (F.linear with torch's preferred BLAS library set to cuBLASLt) and `triton` (the
Triton kernel below, at its best configuration for that shape and M: each program streams a BLOCK_N-row strip
of W over the whole K against all of x's rows, so N / BLOCK_N programs fill the GPU).

Result on the H100 (benchmarks/results/decode_gemm_h100): where it beat cuBLAS the kernel saved 4-6% of a
layer's four projections at 1-16 rows and under 2% at 32-64 when each is timed alone, but a decode step with it chosen per projection (timed at
start, as a worker would) was no faster (benchmarks.gpu.engine_speed in the same lease), so the engine keeps
cuBLAS and the kernel lives only here.

    PYTHONPATH=$PWD python -m benchmarks.gpu.decode_gemm            # prints a table, saves decode_gemm.json
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import copy_bandwidth_gbs, save

MAX_ROWS = 128  # one block of x's rows


@dataclass(frozen=True)
class GemvConfig:
    """One compiled variant of the kernel: tile sizes and the launch's warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def fits(self, m: int, n: int, k: int) -> bool:
        return m <= self.block_m and n % self.block_n == 0 and k % self.block_k == 0


def block_m_for(m: int) -> int:
    """x's rows padded to the kernel's block (>= 16: the tensor-core dot's smallest side)."""
    if m > MAX_ROWS:
        raise ValueError(f"gemv serves at most {MAX_ROWS} rows, got {m}")
    return max(16, 1 << (m - 1).bit_length())


def candidate_configs(m: int, n: int, k: int) -> list[GemvConfig]:
    """The configurations worth timing for an (m, n, k) problem."""
    bm = block_m_for(m)
    out = []
    for bn in (16, 32, 64):
        for bk in (128, 256):
            if bm >= 64 and bk > 128:
                continue  # x's tile alone would fill shared memory over the stages
            for warps in (4, 8):
                for stages in (3, 5):
                    cfg = GemvConfig(bm, bn, bk, warps, stages)
                    if cfg.fits(m, n, k):
                        out.append(cfg)
    return out


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, y_ptr, M, K, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm[:, None] < M
        x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
        w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask, other=0.0)
            w = tl.load(w_ptrs)
            acc = tl.dot(x, tl.trans(w), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask)

    return gemv_kernel


def gemv(x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] with one launch of the kernel; the caller checks `config.fits`."""
    m, k = x.shape
    n = weight.shape[0]
    if not config.fits(m, n, k) or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv config {config} does not serve x {tuple(x.shape)} @ W {tuple(weight.shape)}^T")
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if out is None else out
    _kernel()[(n // config.block_n,)](
        x, weight, y, m, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return y


SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
NUM_COPIES = 12
METHODS = ("linear", "wt", "cublaslt", "triton")


def graph_ms(fn: Callable[..., Any], iters: int = 20) -> float:
    """Milliseconds per call of fn(i) for i over the weight copies, captured once as a graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(NUM_COPIES):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(NUM_COPIES):
            fn(i)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters / NUM_COPIES


def time_batch(name: str, ws: list[torch.Tensor], wts: list[torch.Tensor], m: int, copy_gbs: float) -> dict[str, Any]:
    """Every method on one projection at M rows: microseconds per GEMM and the fraction of copy bandwidth."""
    n, k = ws[0].shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    result: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
    default_blas = torch.backends.cuda.preferred_blas_library()
    result["linear_us"] = graph_ms(lambda i: torch.mm(x, ws[i].t(), out=y)) * 1e3
    result["wt_us"] = graph_ms(lambda i: torch.mm(x, wts[i], out=y)) * 1e3
    torch.backends.cuda.preferred_blas_library("cublaslt")
    result["cublaslt_us"] = graph_ms(lambda i: torch.mm(x, ws[i].t(), out=y)) * 1e3
    torch.backends.cuda.preferred_blas_library(default_blas)
    best = None
    for cfg in candidate_configs(m, n, k):
        try:
            us = graph_ms(lambda i, c=cfg: gemv(x, ws[i], out=y, config=c)) * 1e3
        except Exception as e:  # noqa: BLE001 - a configuration the compiler refuses: skip it
            print(f"  {name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or us < best[0]:
            best = (us, cfg)
    if best is not None:
        result["triton_us"], result["triton_config"] = best[0], best[1].as_dict()
        out = gemv(x, ws[0], config=best[1]).float()
        result["triton_max_rel_err"] = float((out - ref).abs().max() / ref.abs().max())
    nbytes = n * k * 2
    for key in METHODS:
        if f"{key}_us" in result:
            result[f"{key}_frac"] = nbytes / (result[f"{key}_us"] * 1e-6) / 1e9 / copy_gbs
    print(f"{name:8s} m={m:4d}  " + "  ".join(
        f"{key} {result[f'{key}_us']:7.1f}us {result[f'{key}_frac']:.2f}" for key in METHODS if f"{key}_us" in result)
        + (f"  {result['triton_config']}" if "triton_config" in result else ""), flush=True)
    return result


def time_shape(name: str, batches: list[int], copy_gbs: float) -> list[dict[str, Any]]:
    n, k = SHAPES[name]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(NUM_COPIES)]
    wts = [w.t().contiguous() for w in ws]
    rows = [time_batch(name, ws, wts, m, copy_gbs) for m in batches]
    del ws, wts
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,2,4,8,16,24,32,48,64,96,128", help="decode rows M, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="projections: " + ", ".join(SHAPES))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    copy_gbs = copy_bandwidth_gbs()  # bytes read plus written, as engine_speed's decode fractions use it
    print(f"copy bandwidth {copy_gbs:.0f} GB/s")
    rows = [row for name in args.shapes.split(",") for row in time_shape(name, batches, copy_gbs)]
    save("decode_gemm", {"copy_gbs": copy_gbs, "num_copies": NUM_COPIES, "rows": rows})


if __name__ == "__main__":
    main()
