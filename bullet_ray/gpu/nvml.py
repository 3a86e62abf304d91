"""A thin pynvml wrapper: GPU identity, memory, SM count, utilization and per-process memory.

Every function returns None (or an empty list) instead of raising when pynvml, the driver or the GPU is
missing, so callers (node agent, metrics) need no GPU checks of their own.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict[str, Any] = {"module": None, "tried": False}


@dataclass(frozen=True)
class GpuMemory:
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class GpuUtilization:
    gpu_percent: int  # share of time a kernel ran
    memory_percent: int  # share of time device memory was read or written


@dataclass(frozen=True)
class ProcessMemory:
    pid: int
    used_bytes: int | None  # None where the driver does not say (e.g. MPS clients, containers)


def _nvml() -> Any:
    """The initialized pynvml module, or None."""
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "pynvml is deprecated" on some installs
                    import pynvml
                pynvml.nvmlInit()
                _state["module"] = pynvml
            except Exception as e:  # ImportError, NVMLError (no driver / no GPU)
                logger.debug("NVML unavailable: %s", e)
        return _state["module"]


def _handle(index: int) -> tuple[Any, Any] | None:
    nv = _nvml()
    if nv is None:
        return None
    try:
        return nv, nv.nvmlDeviceGetHandleByIndex(index)
    except Exception:
        return None


def device_count() -> int:
    nv = _nvml()
    try:
        return int(nv.nvmlDeviceGetCount()) if nv else 0
    except Exception:
        return 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_uuid(index: int = 0) -> str | None:
    h = _handle(index)
    try:
        return _text(h[0].nvmlDeviceGetUUID(h[1])) if h else None
    except Exception:
        return None


def gpu_name(index: int = 0) -> str | None:
    h = _handle(index)
    try:
        return _text(h[0].nvmlDeviceGetName(h[1])) if h else None
    except Exception:
        return None


def memory(index: int = 0) -> GpuMemory | None:
    h = _handle(index)
    try:
        if h is None:
            return None
        info = h[0].nvmlDeviceGetMemoryInfo(h[1])
        return GpuMemory(int(info.used), int(info.total))
    except Exception:
        return None


def sm_count(index: int = 0) -> int | None:
    """Multiprocessor count from nvmlDeviceGetAttributes; None where NVML does not give it (then ask
    bullet_ray.gpu.smctl.capabilities)."""
    h = _handle(index)
    if h is None:
        return None
    nv, dev = h
    try:
        attrs = nv.nvmlDeviceGetAttributes(dev)  # also valid without MIG: the whole GPU
        return int(attrs.multiprocessorCount)
    except Exception:
        return None


def utilization(index: int = 0) -> GpuUtilization | None:
    h = _handle(index)
    try:
        if h is None:
            return None
        u = h[0].nvmlDeviceGetUtilizationRates(h[1])
        return GpuUtilization(int(u.gpu), int(u.memory))
    except Exception:
        return None


def process_memory(index: int = 0) -> list[ProcessMemory]:
    """Compute processes on the GPU with their memory (empty without a GPU)."""
    h = _handle(index)
    if h is None:
        return []
    nv, dev = h
    try:
        procs = nv.nvmlDeviceGetComputeRunningProcesses(dev)
    except Exception:
        return []
    out = []
    for p in procs:
        used = getattr(p, "usedGpuMemory", None)
        out.append(ProcessMemory(int(p.pid), int(used) if isinstance(used, int) and used >= 0 else None))
    return out


def snapshot(index: int = 0) -> dict[str, Any]:
    """Everything above as one dict (for logs and the self-test); fields are None without a GPU."""
    mem = memory(index)
    util = utilization(index)
    return {"uuid": gpu_uuid(index), "name": gpu_name(index), "sm_count": sm_count(index),
            "memory_used_bytes": mem.used_bytes if mem else None, "memory_total_bytes": mem.total_bytes if mem else None,
            "gpu_util_percent": util.gpu_percent if util else None,
            "processes": [p.__dict__ for p in process_memory(index)]}


def power_watts(index: int = 0) -> float | None:
    """Power draw (W); None without a GPU or where the driver does not say."""
    h = _handle(index)
    try:
        return h[0].nvmlDeviceGetPowerUsage(h[1]) / 1000.0 if h else None
    except Exception:
        return None


def sm_clock_mhz(index: int = 0) -> int | None:
    """The SM clock now (MHz); None without a GPU or where the driver does not say."""
    h = _handle(index)
    try:
        return int(h[0].nvmlDeviceGetClockInfo(h[1], h[0].NVML_CLOCK_SM)) if h else None
    except Exception:
        return None
