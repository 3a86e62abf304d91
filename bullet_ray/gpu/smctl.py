"""ctypes binding of native/libsmctl (the green-context SM-partition helper) with typed errors.

`capabilities(device)` raises NoDriverError on a machine without a CUDA driver or GPU (the error's
`reason` says why); callers that want a report instead use `capability_report(device)`, which never
raises for a missing driver. `NativeLadder` makes complementary splits and returns CUstream handles as
integers, which `torch.cuda.ExternalStream` wraps. The shared library is native/libsmctl.so when that
build is at least as new as its sources, else it is built with gcc into a cache folder
($BULLET_RAY_CACHE_DIR or ~/.cache/bullet_ray) on first use.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SIDE_DECODE = 1
SIDE_PREFILL = 2
SIDE_BOTH = 3
SMCTL_OK, SMCTL_ENODRIVER, SMCTL_ENOTSUP, SMCTL_EINVAL, SMCTL_ECUDA, SMCTL_ENOMEM = 0, -1, -2, -3, -4, -5
_SOURCES = ("smctl.c", "smctl.h")


def _native_dir() -> Path:
    """native/ of a source checkout, else the sources a wheel installs under <prefix>/share/bullet_ray/native."""
    checkout = Path(__file__).resolve().parents[2] / "native"
    if (checkout / _SOURCES[0]).is_file():
        return checkout
    return Path(sysconfig.get_path("data")) / "share" / "bullet_ray" / "native"


NATIVE_DIR = _native_dir()
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


class SmctlError(RuntimeError):
    """Base of the native helper's errors; `code` is the SMCTL_E* value."""

    code = 0

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason = message


class NoDriverError(SmctlError):
    """No CUDA driver or no usable GPU on this machine (SMCTL_ENODRIVER)."""

    code = SMCTL_ENODRIVER


class NotSupportedError(SmctlError):
    """The driver lacks green contexts: CUDA 12.4+ (R550+) is needed (SMCTL_ENOTSUP)."""

    code = SMCTL_ENOTSUP


class InvalidArgumentError(SmctlError, ValueError):
    """A bad argument: SM count, device, side mask, ladder index (SMCTL_EINVAL)."""

    code = SMCTL_EINVAL


class CudaError(SmctlError):
    """A driver call failed (SMCTL_ECUDA): `cuda_error` is the CUresult, `cuda_error_name` its name."""

    code = SMCTL_ECUDA

    def __init__(self, message: str, cuda_error: int, cuda_error_name: str = "?") -> None:
        super().__init__(message)
        self.cuda_error = cuda_error
        self.cuda_error_name = cuda_error_name


class _Caps(ctypes.Structure):
    _fields_ = [("driver_version", ctypes.c_int), ("sm_count", ctypes.c_int), ("green_ctx_supported", ctypes.c_int),
                ("min_partition_sms", ctypes.c_int), ("partition_alignment", ctypes.c_int),
                ("reason", ctypes.c_char * 160)]


class _Entry(ctypes.Structure):
    _fields_ = [("decode_sms", ctypes.c_int), ("prefill_sms", ctypes.c_int),
                ("decode_stream", ctypes.c_size_t), ("prefill_stream", ctypes.c_size_t)]


@dataclass(frozen=True)
class Capabilities:
    """What the device allows. Without a driver (from capability_report): zeros and a reason."""

    driver_version: int  # e.g. 13000 for CUDA 13.0; 0 without a driver
    sm_count: int
    green_ctx_supported: bool
    min_partition_sms: int  # 0 when the driver does not say
    partition_alignment: int  # SM groups are multiples of this; 0 when the driver does not say
    reason: str  # why green contexts (or the driver) are missing; "" when supported

    @property
    def has_gpu(self) -> bool:
        return self.sm_count > 0

    @property
    def granularity(self) -> int:
        """SM step of the ladder: the driver's alignment, else 8 (Hopper's, measured on the H100)."""
        return max(self.partition_alignment, self.min_partition_sms, 0) or 8

    def as_dict(self) -> dict[str, object]:
        return {"driver_version": self.driver_version, "sm_count": self.sm_count,
                "green_ctx_supported": self.green_ctx_supported, "min_partition_sms": self.min_partition_sms,
                "partition_alignment": self.partition_alignment, "reason": self.reason}


@dataclass(frozen=True)
class NativeEntry:
    decode_sms: int
    prefill_sms: int
    decode_stream: int  # CUstream as an integer; 0 when this process did not make that side
    prefill_stream: int


def _is_fresh(so: Path) -> bool:
    return so.exists() and all(so.stat().st_mtime >= (NATIVE_DIR / s).stat().st_mtime for s in _SOURCES)


def build(target: Path) -> Path:
    """Compile native/smctl.c into `target` with the C compiler ($CC or gcc); SmctlError if none is found."""
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise SmctlError("native/libsmctl.so is not built and no C compiler was found: install gcc or run "
                         "`make -C native`")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    cmd = [cc, "-O2", "-fPIC", "-std=c11", "-shared", "-o", tmp, str(NATIVE_DIR / "smctl.c"), "-ldl", "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        os.unlink(tmp)
        raise SmctlError(f"building libsmctl failed ({' '.join(cmd)}): {proc.stderr.strip()}")
    os.replace(tmp, target)
    logger.info("built %s", target)
    return target


def library_path() -> Path:
    """native/libsmctl.so if it is up to date, else a build in the cache folder (made on demand)."""
    in_tree = NATIVE_DIR / "libsmctl.so"
    if _is_fresh(in_tree):
        return in_tree
    cache = Path(os.environ.get("BULLET_RAY_CACHE_DIR") or Path.home() / ".cache" / "bullet_ray") / "native"
    target = cache / "libsmctl.so"
    return target if _is_fresh(target) else build(target)


def _declare(so: ctypes.CDLL) -> None:
    c_int, c_void_p, c_char_p = ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p
    so.smctl_version.argtypes, so.smctl_version.restype = [], c_int
    so.smctl_capabilities.argtypes, so.smctl_capabilities.restype = [c_int, ctypes.POINTER(_Caps)], c_int
    so.smctl_ladder_create.argtypes = [c_int, ctypes.POINTER(c_int), c_int, c_int, c_int, c_int,
                                       ctypes.POINTER(c_void_p)]
    so.smctl_ladder_create.restype = c_int
    so.smctl_ladder_size.argtypes, so.smctl_ladder_size.restype = [c_void_p], c_int
    so.smctl_ladder_entry.argtypes, so.smctl_ladder_entry.restype = [c_void_p, c_int, ctypes.POINTER(_Entry)], c_int
    so.smctl_ladder_destroy.argtypes, so.smctl_ladder_destroy.restype = [c_void_p], None
    so.smctl_last_cuda_error.argtypes, so.smctl_last_cuda_error.restype = [], c_int
    so.smctl_cuda_error_name.argtypes, so.smctl_cuda_error_name.restype = [c_int], c_char_p
    so.smctl_last_error.argtypes, so.smctl_last_error.restype = [], c_char_p
    so.smctl_strerror.argtypes, so.smctl_strerror.restype = [c_int], c_char_p


def lib() -> ctypes.CDLL:
    """The loaded library (built first if needed), with argtypes/restype declared on every function."""
    global _lib
    with _lock:
        if _lib is None:
            so = ctypes.CDLL(str(library_path()))
            _declare(so)
            _lib = so
        return _lib


def _raise(code: int) -> None:
    so = lib()
    message = (so.smctl_last_error() or b"").decode() or so.smctl_strerror(code).decode()
    if code == SMCTL_ENODRIVER:
        raise NoDriverError(message)
    if code == SMCTL_ENOTSUP:
        raise NotSupportedError(message)
    if code == SMCTL_EINVAL:
        raise InvalidArgumentError(message)
    if code == SMCTL_ECUDA:
        cu = int(so.smctl_last_cuda_error())
        raise CudaError(message, cu, (so.smctl_cuda_error_name(cu) or b"?").decode())
    raise SmctlError(f"smctl error {code} ({so.smctl_strerror(code).decode()}): {message}")


def version() -> int:
    """SMCTL_VERSION of the loaded library (200 = 0.2.0)."""
    return int(lib().smctl_version())


def capabilities(device: int = 0) -> Capabilities:
    """The device's partitioning capabilities. Raises NoDriverError without a CUDA driver or GPU,
    InvalidArgumentError for a device out of range. Green contexts may still be unsupported: see
    `green_ctx_supported` and `reason`."""
    caps = _Caps()
    rc = lib().smctl_capabilities(device, ctypes.byref(caps))
    if rc != SMCTL_OK:
        _raise(rc)
    return Capabilities(caps.driver_version, caps.sm_count, bool(caps.green_ctx_supported), caps.min_partition_sms,
                        caps.partition_alignment, caps.reason.decode())


def capability_report(device: int = 0) -> Capabilities:
    """Like capabilities(), but a machine without a driver (or without gcc to build the library) gives a
    report with sm_count 0 and the reason instead of an exception."""
    try:
        return capabilities(device)
    except NoDriverError as e:
        return Capabilities(0, 0, False, 0, 0, e.reason)
    except SmctlError as e:
        if isinstance(e, InvalidArgumentError | CudaError):
            raise
        return Capabilities(0, 0, False, 0, 0, str(e))


class NativeLadder:
    """Complementary green-context splits, one per decode SM count; this process makes the streams of the
    sides in `side_mask` only. `close()` destroys them (finish the work queued on them first)."""

    def __init__(self, device: int, decode_sm_counts: list[int], side_mask: int, decode_priority: int = -1,
                 prefill_priority: int = 0) -> None:
        counts = (ctypes.c_int * max(1, len(decode_sm_counts)))(*decode_sm_counts)
        handle = ctypes.c_void_p()
        rc = lib().smctl_ladder_create(device, counts, len(decode_sm_counts), side_mask, decode_priority,
                                       prefill_priority, ctypes.byref(handle))
        if rc != SMCTL_OK:
            _raise(rc)
        self._handle = handle
        self.entries: list[NativeEntry] = []
        for i in range(lib().smctl_ladder_size(handle)):
            e = _Entry()
            rc = lib().smctl_ladder_entry(handle, i, ctypes.byref(e))
            if rc != SMCTL_OK:
                self.close()
                _raise(rc)
            self.entries.append(NativeEntry(e.decode_sms, e.prefill_sms, e.decode_stream, e.prefill_stream))

    def close(self) -> None:
        if self._handle:
            lib().smctl_ladder_destroy(self._handle)
            self._handle = ctypes.c_void_p()

    def __enter__(self) -> NativeLadder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
