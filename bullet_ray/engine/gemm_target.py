"""cuBLAS told how many SMs a partition has, for decode graphs captured on a partition smaller than the GPU.

cuBLAS picks its GEMM kernels and grids for the device's SMs (132 on an H100) even when the stream runs on a
green context of 16. cuBLASLt takes a target SM count (CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET), which PyTorch
sets from its experimental SM carveout (target = device SMs - carveout) on matmuls routed through cuBLASLt.
On the H100 (benchmarks/results/sm_target_h100/, eager steps of dummy Llama-3.1-8B) the target made decode of
32 sequences x 1k context 1.24x faster on 16 SMs, 1.19x on 32 and 1.09-1.10x on 48-64, 128 sequences
1.06-1.10x, except on 48 SMs where it made them 2x slower; prefill steps were slower with it on every
partition (0.70-1.01x), so only decode graphs use it. A graph keeps the kernels it was captured with, so the
decode worker captures each bucket of a partition twice, with and without the target, times a few
replays of each and keeps the faster (`DecodeGraphs._capture_tuned`). `BULLET_RAY_GEMM_SM_TARGET=0` turns
the tuning off (every graph captured as before); so does a PyTorch without the SM carveout (before 2.7).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

# a target must beat the plain capture by this much to be kept: replays vary by ~1%
MARGIN = 0.02
_ON, _OFF = ("tune", "1"), ("0", "off")


def tuning_enabled() -> bool:
    """BULLET_RAY_GEMM_SM_TARGET: "tune" or "1" (default: tune), "0" or "off"; off also where this PyTorch
    has no SM carveout (logged once)."""
    value = os.environ.get("BULLET_RAY_GEMM_SM_TARGET", "tune")
    if value not in _ON + _OFF:
        raise ValueError(f"BULLET_RAY_GEMM_SM_TARGET must be one of {', '.join(_ON + _OFF)}, got {value!r}")
    return value in _ON and _torch_has_carveout()


@functools.cache
def _torch_has_carveout() -> bool:
    if hasattr(torch._C, "_set_sm_carveout_experimental"):
        return True
    logger.warning("torch %s has no SM carveout (PyTorch >= 2.7): decode graphs are not tuned for cuBLAS's SM "
                   "target", torch.__version__)
    return False


@contextlib.contextmanager
def sm_target(sms: int, device_sms: int) -> Iterator[None]:
    """Inside: this process's matmuls go through cuBLASLt aimed at `sms` of the device's `device_sms` SMs;
    PyTorch's library choice and carveout are restored on the way out."""
    if not 0 < sms < device_sms:
        raise ValueError(f"an SM target needs 0 < sms < {device_sms}, got {sms}")
    library = torch.backends.cuda.preferred_blas_library()
    carveout = torch._C._get_sm_carveout_experimental()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        torch._C._set_sm_carveout_experimental(device_sms - sms)
        yield
    finally:
        torch._C._set_sm_carveout_experimental(carveout)
        torch.backends.cuda.preferred_blas_library(library)


def keeps_target(plain_ms: float, targeted_ms: float, margin: float = MARGIN) -> bool:
    """Whether the graph captured with the SM target is kept: faster than the plain one by more than `margin`."""
    return targeted_ms < plain_ms * (1.0 - margin)
