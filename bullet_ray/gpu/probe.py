"""Which SMs does work on a stream run on? A kernel (native/smid_probe.cu, built with nvcc on GPU machines)
records each block's SM id; used to check partitions by their effect (GPU tests, benchmarks, self-test)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import threading
from typing import Any

from bullet_ray.gpu.smctl import NATIVE_DIR, SmctlError

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def available() -> bool:
    """The probe library is built, or nvcc is here to build it."""
    return (NATIVE_DIR / "libsmid_probe.so").exists() or shutil.which("nvcc") is not None


def _load() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            so = NATIVE_DIR / "libsmid_probe.so"
            if not so.exists() or so.stat().st_mtime < (NATIVE_DIR / "smid_probe.cu").stat().st_mtime:
                proc = subprocess.run(["make", "-s", "-C", str(NATIVE_DIR), "probe"], capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SmctlError(f"building the SM-id probe failed (needs nvcc): {proc.stderr.strip()}")
            lib = ctypes.CDLL(str(so))
            lib.smid_probe_launch.argtypes = [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong]
            lib.smid_probe_launch.restype = ctypes.c_int
            _lib = lib
        return _lib


def sm_ids(stream: Any = None, num_blocks: int = 2048, spin_us: float = 20.0) -> set[int]:
    """The SM ids that `num_blocks` blocks launched on `stream` (torch stream; None: current) ran on."""
    import torch

    s = stream if stream is not None else torch.cuda.current_stream()
    out = torch.full((num_blocks,), -1, dtype=torch.int32, device="cuda")
    s.wait_stream(torch.cuda.current_stream())  # `out` is ready before the probe writes it
    rc = _load().smid_probe_launch(s.cuda_stream, out.data_ptr(), num_blocks, int(spin_us * 1000))
    if rc != 0:
        raise SmctlError(f"SM-id probe launch failed: cudaError {rc}")
    s.synchronize()
    ids = out.cpu().tolist()
    if min(ids) < 0:
        raise SmctlError("SM-id probe: some blocks did not write their SM id")
    return set(ids)
