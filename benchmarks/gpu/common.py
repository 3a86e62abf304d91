"""Shared helpers of the GPU benchmark scripts: timing with CUDA events, result files with device/date/command."""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any


def time_cuda(fn: Callable[[], Any], iters: int = 20, warmup: int = 3, stream: Any = None) -> float:
    """Median milliseconds of fn() measured with CUDA events on `stream` (default: current stream)."""
    import torch

    s = stream or torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(s)
            fn()
            end.record(s)
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def on_stream(fn: Callable[[], Any], stream: Any) -> tuple[Callable[[], Any], Callable[[], None]]:
    """(fn launched on `stream` (None: the current one), a wait for that stream (None: the whole device)): how the
    partition scripts time a step on a green context's stream."""
    import torch

    def run() -> Any:
        if stream is None:
            return fn()
        with torch.cuda.stream(stream):
            return fn()

    return run, (stream.synchronize if stream is not None else torch.cuda.synchronize)


def whole_gpu_green_stream(device: int = 0) -> tuple[Any, Callable[[], None]]:
    """(a torch stream of a green context holding every SM of `device`, its close): the control that tells a green
    context's own cost from a partition's size. Made here through the driver API (ctypes), with the CUdevResource
    layout of native/smctl.c (144 bytes in CUDA 12.4-13.0; a larger buffer is passed)."""
    import ctypes

    import torch

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed with CUresult {rc}")

    torch.cuda.init()
    dev = ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    res = (ctypes.c_ubyte * 512)()
    check(cuda.cuDeviceGetDevResource(dev, res, 1), "cuDeviceGetDevResource(SM)")  # 1: CU_DEV_RESOURCE_TYPE_SM
    desc, green, handle = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuDevResourceGenerateDesc(ctypes.byref(desc), res, 1), "cuDevResourceGenerateDesc")
    check(cuda.cuGreenCtxCreate(ctypes.byref(green), desc, dev, 1), "cuGreenCtxCreate")  # 1: DEFAULT_STREAM
    check(cuda.cuGreenCtxStreamCreate(ctypes.byref(handle), green, 1, 0), "cuGreenCtxStreamCreate")  # NON_BLOCKING
    stream = torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", device))

    def close() -> None:
        torch.cuda.synchronize()
        cuda.cuStreamDestroy_v2(handle)
        cuda.cuGreenCtxDestroy(green)

    return stream, close


def partition_places(decode_sms: list[int], green_whole: bool = False, skipped: list[dict[str, Any]] | None = None
                     ) -> tuple[list[tuple[str, int, Any]], Callable[[], None]]:
    """The places the partition scripts time on, as (label, SMs, stream) with stream None for the current one: the
    whole GPU; with `green_whole` a green context holding every SM (`whole_gpu_green_stream`); per decode SM count the
    prefill stream of its own green split ("prefill<SMs>"). And one close for all of them. A count the driver
    refuses raises, or, with a `skipped` list, is recorded there and left out."""
    import torch

    from bullet_ray.gpu.partition import make_partitioner

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    places: list[tuple[str, int, Any]] = [("whole", sm_count, None)]
    closers: list[Callable[[], None]] = []

    def close() -> None:
        for c in closers:
            c()

    try:
        if green_whole:
            stream, close_green = whole_gpu_green_stream()
            closers.append(close_green)
            places.append((f"green{sm_count}", sm_count, stream))
        for count in decode_sms:
            try:
                part = make_partitioner("green", "both", 0, [count])
            except Exception as e:  # noqa: BLE001 - the driver may refuse a count: say so, measure the rest
                if skipped is None:
                    raise
                skipped.append({"decode_sms": count, "error": str(e)[:200]})
                print(f"decode {count} SMs: skipped ({e})")
                continue
            closers.append(part.close)
            entry = part.ladder[0]
            places.append((f"prefill{entry.prefill_sms}", entry.prefill_sms, part.stream(0, "prefill")))
    except BaseException:
        close()
        raise
    return places, close


def time_back_to_back(fn: Callable[[], Any], iters: int = 20, warmup: int = 3, stream: Any = None) -> float:
    """Milliseconds per call of fn() issued `iters` times without waiting in between (the host runs ahead
    of the GPU as far as fn lets it), from CUDA events around the whole run, on `stream` (None: the current
    one; fn runs with it as the current stream)."""
    import torch

    s = stream or torch.cuda.current_stream()
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(s)
        for _ in range(iters):
            fn()
        end.record(s)
        end.synchronize()
    return start.elapsed_time(end) / iters


def device_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"name": props.name, "sms": props.multi_processor_count, "memory_gb": round(props.total_memory / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.version.cuda}


def save(name: str, payload: dict[str, Any]) -> str:
    """Write payload with device, date and command to $OUT/<name>.json (or benchmarks/results/)."""
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    payload = {"benchmark": name, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "device": device_info(), "command": "python " + " ".join(sys.argv), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"saved {path}")
    return path


def peak_gemm_tflops() -> float:
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: a @ b, iters=10)
    return 2 * 8192**3 / (ms / 1e3) / 1e12


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy, counting bytes read plus written."""
    import torch

    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = time_cuda(lambda: y.copy_(x), iters=10)
    return 2 * x.numel() / (ms / 1e3) / 1e9
