"""Where a prefill step's time goes on a green-context partition, kernel by kernel, against the whole GPU.

Why (docs/policy.md, twenty-sixth session): a 2,048-token prefill step takes 52.98 ms on the whole H100 and
66.98 ms on 116 of its 132 SMs (`results/sm_target_h100/`): 0.79 of the speed for 0.88 of the SMs, and the
speed hardly moves from 68 to 116 SMs. The bf16 GEMM probe of `sm_partition_h100.json` scales about linearly
(676 TFLOP/s on 116 SMs), so something else in the step does not follow the partition. This script says what,
for each place (the whole GPU on the default stream, then the prefill stream of each ladder entry):
- `step`: the step as the engine runs it (`Bench.step_fn`: metadata, eager forward, lm_head), median ms;
- `kernels`: one torch.profiler window of `--profile-steps` steps: kernel ms per step by class (GEMM,
  attention, norm, activation, rotary, other), the kernel count, the GPU's busy share of the window
  (union of kernel intervals over first start to last end) and the ten slowest kernel names;
- `clocks`: the step run back to back for `--sustain-s` while NVML samples the SM clock and the board power
  (a partition that runs cooler may clock higher; a whole-GPU step may be power-capped);
- `gemms`: each projection of a layer alone (`F.linear` with the engine's fused weights' shapes, T rows),
  TFLOP/s, so a GEMM that does not scale shows as such;
- with `--gemm-modes`, the step, its kernels (names and launch grids) and the projections again under each
  BLAS mode (cuBLASLt with or without an SM target, cuBLAS's own cublasSetSmCountTarget).

First result (H200, `benchmarks/results/prefill_kernels_h200/`): cuBLAS's nvjet GEMMs launch a persistent grid
of 132 CTAs (the device's SMs, one per SM) on every partition, and the qkv / o / down projections lose most.

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.prefill_kernels --out $OUT/prefill_kernels
    python -m benchmarks.gpu.prefill_kernels --help

Writes prefill_kernels.json (and each window's chrome trace, gzipped) to --out; prints one table.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.gpu.common import on_stream, partition_places
from benchmarks.gpu.sm_target import MODES as LT_MODES
from benchmarks.gpu.sm_target import set_mode
from bullet_ray.gpu import nvml

# cuBLAS (not Lt) told the partition's SMs through cublasSetSmCountTarget on PyTorch's handle
SMCOUNT = "cublas+smcount"
MODES = (*LT_MODES, SMCOUNT)

CLASSES = (  # (class, substrings of a kernel's name), first match wins
    ("attention", ("flashinfer::Prefill", "flashinfer::BatchPrefill", "flashinfer::BatchDecode", "MergeStates",
                   "fmha", "flash_fwd", "FlashAttn")),
    ("norm", ("RMSNorm", "rms_norm", "layer_norm")),
    ("activation", ("act_and_mul", "silu")),
    ("rotary", ("Rotary", "rotary", "rope")),
    ("gemm", ("nvjet", "gemm", "cutlass", "sm90_xmma", "ampere_bf16", "cublas")),  # last: attention templates name cutlass
)


def kernel_class(name: str) -> str:
    for cls, keys in CLASSES:
        if any(k in name for k in keys):
            return cls
    return "other"


def summarize_trace(trace: dict[str, Any], steps: int) -> dict[str, Any]:
    """Kernel ms per step by class, kernel count per step, the busy share of the window, the slowest names."""
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {"kernels_found": 0}
    by_class: dict[str, float] = {}
    by_name: dict[str, float] = {}
    grids: dict[str, Any] = {}  # name -> the launch grid of its first call (a persistent kernel's is the SM count)
    for e in kernels:
        grids.setdefault(e["name"], (e.get("args") or {}).get("grid"))
        by_class[kernel_class(e["name"])] = by_class.get(kernel_class(e["name"]), 0.0) + e["dur"]
        by_name[e["name"]] = by_name.get(e["name"], 0.0) + e["dur"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    busy, cur_s, cur_e = 0.0, spans[0][0], spans[0][1]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    window = spans[-1][1] - spans[0][0]
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    return {"kernels_per_step": round(len(kernels) / steps, 1),
            "kernel_ms_per_step": round(sum(by_class.values()) / steps / 1e3, 3),
            "by_class_ms": {k: round(v / steps / 1e3, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "busy_share": round(busy / window, 4) if window > 0 else None,
            "window_ms_per_step": round(window / steps / 1e3, 3),
            "top": [{"name": n[:120], "ms_per_step": round(d / steps / 1e3, 3), "grid": grids[n]} for n, d in top]}


def profile_window(torch: Any, run: Any, sync: Any, steps: int, trace_path: Path) -> dict[str, Any]:
    """`steps` runs under torch.profiler; the chrome trace saved gzipped at trace_path + .gz; its summary."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run()
        sync()
    prof.export_chrome_trace(str(trace_path))
    trace = json.loads(trace_path.read_text())
    with gzip.open(str(trace_path) + ".gz", "wt") as f:
        json.dump(trace, f)
    trace_path.unlink()
    return summarize_trace(trace, steps)


class NvmlSampler:
    """SM clock (MHz) and board power (W) every `period_s` on a thread, while inside `with`
    (bullet_ray.gpu.nvml; without NVML nothing is sampled and the summary is empty)."""

    def __init__(self, device: int = 0, period_s: float = 0.02) -> None:
        self.device, self.period_s, self._stop = device, period_s, threading.Event()
        self.samples: list[tuple[float, float]] = []
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            clock, power = nvml.sm_clock_mhz(self.device), nvml.power_watts(self.device)
            if clock is not None and power is not None:
                self.samples.append((clock, power))
            time.sleep(self.period_s)

    def __enter__(self) -> NvmlSampler:
        if nvml.sm_clock_mhz(self.device) is None:
            print("NVML unavailable; no clocks")
        else:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    def summary(self) -> dict[str, Any]:
        if not self.samples:
            return {}
        clocks, power = [s[0] for s in self.samples], [s[1] for s in self.samples]
        return {"sm_clock_mhz_median": statistics.median(clocks), "sm_clock_mhz_min": min(clocks),
                "power_w_median": round(statistics.median(power), 1), "power_w_max": round(max(power), 1),
                "samples": len(clocks)}


def _cublas() -> Any:
    """libcublas as this process loaded it (PyTorch's copy: the path from /proc/self/maps)."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "libcublas.so" in line and "libcublasLt" not in line}
    if not paths:
        raise RuntimeError("libcublas is not loaded (run a matmul first)")
    return ctypes.CDLL(sorted(paths)[0])


def cublas_sm_count_target(torch: Any, sms: int) -> None:
    """cublasSetSmCountTarget(PyTorch's cuBLAS handle of this thread, sms); 0 restores the device's count."""
    import ctypes

    rc = _cublas().cublasSetSmCountTarget(ctypes.c_void_p(torch.cuda.current_blas_handle()), ctypes.c_int(sms))
    if rc != 0:
        raise RuntimeError(f"cublasSetSmCountTarget({sms}) returned status {rc}")


def apply_mode(torch: Any, mode: str, sm_count: int, sms: int) -> None:
    """PyTorch's BLAS set-up for `mode` on a partition of `sms` SMs (sm_target's three modes, or SMCOUNT)."""
    if mode == SMCOUNT:
        apply_mode(torch, "cublas", sm_count, sm_count)
        cublas_sm_count_target(torch, sms if sms < sm_count else 0)
    else:
        cublas_sm_count_target(torch, 0)
        set_mode(torch, mode, sm_count, sms)


def projections(cfg: Any) -> dict[str, tuple[int, int]]:
    """(in, out) features of each GEMM of a decoder layer, fused as the engine runs them."""
    h, q, kv, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--decode-sms", default="8,16,32,64",
                        help="ladder entries (decode SMs), each in its own partitioner; prefill gets the rest "
                             "(an entry the driver refuses is reported and skipped)")
    parser.add_argument("--tokens", default="2048,4096", help="prefill batch sizes (one sequence each)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per point (median)")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps in each profiler window")
    parser.add_argument("--sustain-s", type=float, default=1.5, help="seconds of back-to-back steps under NVML")
    parser.add_argument("--gemm-modes", default="cublas",
                        help="comma list of BLAS modes for the projections alone and the step (cublas, cublaslt, "
                             "cublaslt+target as in benchmarks.gpu.sm_target; cublas+smcount: cuBLAS's own "
                             "cublasSetSmCountTarget = the partition's SMs); cublas is always first")
    parser.add_argument("--summarize", nargs="+", type=Path, metavar="TRACE",
                        help="no GPU: print the kernel summary of saved traces (trace_<place>_<tokens>.json.gz; "
                             "--profile-steps steps each) and exit")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")) / "prefill_kernels")
    args = parser.parse_args(argv)
    modes = [m for m in args.gemm_modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or "cublas" not in modes:
        parser.error(f"--gemm-modes: {bad or modes} ; choose from {', '.join(MODES)}, cublas included")
    modes = ["cublas"] + [m for m in modes if m != "cublas"]
    if args.summarize:
        for path in args.summarize:
            with gzip.open(path, "rt") as f:
                print(path.name, json.dumps(summarize_trace(json.load(f), args.profile_steps)))
        return 0

    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    from bullet_ray.perf.sweep import Bench, _time_s

    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args.model, "cuda", "bfloat16", kv_fraction=0.5, use_graphs=False)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    tokens = [int(x) for x in args.tokens.split(",") if x]
    skipped: list[dict[str, Any]] = []
    places, close_places = partition_places([int(x) for x in args.decode_sms.split(",") if x], skipped=skipped)
    shapes = projections(bench.cfg)
    results = []
    points = [(p, n) for p in places for n in tokens]
    for (label, sms, stream), n in tqdm(points, desc="places"):
        run, sync = on_stream(bench.step_fn(bench.batch(1, n, 0), 0), stream)
        row: dict[str, Any] = {"place": label, "sms": sms, "tokens": n}
        t = _time_s(run, sync, args.repeats, 2)
        row["step_ms"] = round(t * 1e3, 3)
        row["tokens_per_s"] = round(n / t)
        row["kernels"] = profile_window(torch, run, sync, args.profile_steps, args.out / f"trace_{label}_{n}.json")
        with NvmlSampler() as sampler:
            began, steps = time.monotonic(), 0
            while time.monotonic() - began < args.sustain_s:
                run()
                steps += 1
                if steps % 4 == 0:
                    sync()
            sync()
            elapsed = time.monotonic() - began
        row["clocks"] = {**sampler.summary(), "steps": steps, "step_ms_sustained": round(elapsed / steps * 1e3, 3)}
        for mode in modes:
            apply_mode(torch, mode, sm_count, sms)
            if mode != "cublas":  # the whole step in this mode too, and its kernels (which grids the mode gave)
                row[f"step_ms[{mode}]"] = round(_time_s(run, sync, args.repeats, 2) * 1e3, 3)
                row[f"kernels[{mode}]"] = profile_window(torch, run, sync, args.profile_steps,
                                                         args.out / f"trace_{label}_{n}_{mode.replace('+', '_')}.json")
            gemms = {}
            for name, (k, m) in shapes.items():
                x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                torch.cuda.synchronize()  # made on the default stream, read on the place's
                g = _time_s(on_stream(functools.partial(F.linear, x, w), stream)[0], sync, 10, 3)
                gemms[name] = {"ms": round(g * 1e3, 4), "tflops": round(2 * n * k * m / g / 1e12, 1)}
                del x, w
            row["gemms" if mode == "cublas" else f"gemms[{mode}]"] = gemms
        apply_mode(torch, "cublas", sm_count, sm_count)
        results.append(row)
        print(json.dumps(row), flush=True)
    close_places()
    out = {"benchmark": "prefill_kernels", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python -m benchmarks.gpu.prefill_kernels " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": {"name": torch.cuda.get_device_name(0), "sms": sm_count, "torch": torch.__version__},
           "skipped": skipped, "results": results}
    (args.out / "prefill_kernels.json").write_text(json.dumps(out, indent=1))
    print(f"\n{'place':12} {'tok':>5} {'step ms':>8} {'tok/s':>7} {'kern ms':>8} {'gemm':>6} {'attn':>6} "
          f"{'busy':>5} {'MHz':>5} {'W':>5}  GEMM TFLOP/s qkv/o/gate_up/down, by mode: {' '.join(modes)}")
    for r in results:
        k, c = r["kernels"], r["clocks"]
        cls = k.get("by_class_ms", {})
        print(f"{r['place']:12} {r['tokens']:>5} {r['step_ms']:>8.2f} {r['tokens_per_s']:>7} "
              f"{k.get('kernel_ms_per_step', 0):>8.2f} {cls.get('gemm', 0):>6.2f} {cls.get('attention', 0):>6.2f} "
              f"{k.get('busy_share') or 0:>5.2f} {c.get('sm_clock_mhz_median', 0):>5} {c.get('power_w_median', 0):>5}  "
              + "  ".join("/".join(f"{g['tflops']:.0f}" for g in r[key].values())
                          for key in r if key.startswith("gemms"))
              + "".join(f"  step[{m}] {r[f'step_ms[{m}]']:.2f} ms" for m in modes[1:]))
    print(f"saved {args.out / 'prefill_kernels.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
