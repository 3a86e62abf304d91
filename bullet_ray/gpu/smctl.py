"""ctypes binding of native/libsmctl.so (green-context SM partitions); builds it with gcc when missing.

Every function has argtypes/restype; failures raise typed exceptions, never exit the process.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

SIDE_DECODE = 1
SIDE_PREFILL = 2
_NATIVE = Path(__file__).resolve().parents[2] / "native"
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class SmctlError(RuntimeError):
    """Base of the native helper's errors."""


class NoDriverError(SmctlError):
    """No CUDA driver or no usable GPU on this machine."""


class NotSupportedError(SmctlError):
    """The driver lacks green contexts (CUDA 12.4+ needed)."""


class InvalidArgumentError(SmctlError, ValueError):
    """A bad argument (SM count, device, side)."""


class CudaError(SmctlError):
    """A driver call failed; `cuda_error` is the CUresult."""

    def __init__(self, message: str, cuda_error: int) -> None:
        super().__init__(message)
        self.cuda_error = cuda_error


class _Caps(ctypes.Structure):
    _fields_ = [("driver_version", ctypes.c_int), ("sm_count", ctypes.c_int), ("green_ctx_supported", ctypes.c_int),
                ("min_partition_sms", ctypes.c_int), ("partition_alignment", ctypes.c_int),
                ("reason", ctypes.c_char * 160)]


class _Entry(ctypes.Structure):
    _fields_ = [("decode_sms", ctypes.c_int), ("prefill_sms", ctypes.c_int),
                ("decode_stream", ctypes.c_size_t), ("prefill_stream", ctypes.c_size_t)]


@dataclass(frozen=True)
class Capabilities:
    driver_version: int
    sm_count: int
    green_ctx_supported: bool
    min_partition_sms: int
    partition_alignment: int
    reason: str


@dataclass(frozen=True)
class NativeEntry:
    decode_sms: int
    prefill_sms: int
    decode_stream: int  # CUstream as an integer; 0 when this process did not make that side
    prefill_stream: int


def library_path() -> Path:
    """native/libsmctl.so, built into a cache folder with gcc if the source tree has no build."""
    built = _NATIVE / "libsmctl.so"
    if built.exists():
        return built
    cache = Path(os.environ.get("BULLET_RAY_CACHE_DIR", Path.home() / ".cache" / "bullet_ray")) / "native"
    target = cache / "libsmctl.so"
    if target.exists() and target.stat().st_mtime >= (_NATIVE / "smctl.c").stat().st_mtime:
        return target
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if cc is None:
        raise SmctlError("native/libsmctl.so is not built and no C compiler was found: run `make -C native`")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache, suffix=".so", delete=False) as tmp:
        subprocess.run([cc, "-O2", "-fPIC", "-std=c11", "-shared", "-o", tmp.name, str(_NATIVE / "smctl.c"),
                        "-ldl", "-lpthread"], check=True, capture_output=True)
        os.replace(tmp.name, target)
    return target


def lib() -> ctypes.CDLL:
    global _lib
    with _lock:
        if _lib is None:
            so = ctypes.CDLL(str(library_path()))
            so.smctl_version.argtypes, so.smctl_version.restype = [], ctypes.c_int
            so.smctl_capabilities.argtypes = [ctypes.c_int, ctypes.POINTER(_Caps)]
            so.smctl_capabilities.restype = ctypes.c_int
            so.smctl_ladder_create.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int,
                                               ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
            so.smctl_ladder_create.restype = ctypes.c_int
            so.smctl_ladder_size.argtypes, so.smctl_ladder_size.restype = [ctypes.c_void_p], ctypes.c_int
            so.smctl_ladder_entry.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_Entry)]
            so.smctl_ladder_entry.restype = ctypes.c_int
            so.smctl_ladder_destroy.argtypes, so.smctl_ladder_destroy.restype = [ctypes.c_void_p], None
            so.smctl_last_cuda_error.argtypes, so.smctl_last_cuda_error.restype = [], ctypes.c_int
            so.smctl_last_error.argtypes, so.smctl_last_error.restype = [], ctypes.c_char_p
            so.smctl_strerror.argtypes, so.smctl_strerror.restype = [ctypes.c_int], ctypes.c_char_p
            _lib = so
        return _lib


def _raise(code: int) -> None:
    so = lib()
    message = (so.smctl_last_error() or b"").decode() or so.smctl_strerror(code).decode()
    if code == -1:
        raise NoDriverError(message)
    if code == -2:
        raise NotSupportedError(message)
    if code == -3:
        raise InvalidArgumentError(message)
    if code == -4:
        raise CudaError(message, so.smctl_last_cuda_error())
    raise SmctlError(f"smctl error {code}: {message}")


def version() -> int:
    return int(lib().smctl_version())


def capabilities(device: int = 0) -> Capabilities:
    """The device's partitioning capabilities. Raises NoDriverError without a CUDA driver."""
    caps = _Caps()
    rc = lib().smctl_capabilities(device, ctypes.byref(caps))
    if rc != 0:
        _raise(rc)
    return Capabilities(caps.driver_version, caps.sm_count, bool(caps.green_ctx_supported), caps.min_partition_sms,
                        caps.partition_alignment, caps.reason.decode())


class NativeLadder:
    """Complementary green-context splits, one per decode SM count; `close()` destroys them."""

    def __init__(self, device: int, decode_sm_counts: list[int], side_mask: int, decode_priority: int = -1,
                 prefill_priority: int = 0) -> None:
        counts = (ctypes.c_int * len(decode_sm_counts))(*decode_sm_counts)
        handle = ctypes.c_void_p()
        rc = lib().smctl_ladder_create(device, counts, len(decode_sm_counts), side_mask, decode_priority,
                                       prefill_priority, ctypes.byref(handle))
        if rc != 0:
            _raise(rc)
        self._handle = handle
        self.entries = []
        for i in range(lib().smctl_ladder_size(handle)):
            e = _Entry()
            rc = lib().smctl_ladder_entry(handle, i, ctypes.byref(e))
            if rc != 0:
                _raise(rc)
            self.entries.append(NativeEntry(e.decode_sms, e.prefill_sms, e.decode_stream, e.prefill_stream))

    def close(self) -> None:
        if self._handle:
            lib().smctl_ladder_destroy(self._handle)
            self._handle = ctypes.c_void_p()
