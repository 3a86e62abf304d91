"""Does the data a GEMM multiplies change its speed? One Llama-3.1-8B layer's four projections on each kind of dummy
data, timed as a short burst (what start-up's bucket tuning times) and over seconds (what a serving run sees), with
the SM clock and board power sampled meanwhile.

Why: at an 8,192-token budget our prompt GEMMs ran ~10% slower inside serving steps than start-up timed the same
sizes, while vLLM's ran at start-up's speed (benchmarks/results/kernel_compare_h200/README.md, kc8192_m17), and the
two engines' dummy weights differ (`bullet_ray.models.loader.DUMMY_INITS`): ours N(0, 0.02) with norm weights near 1
(activations of RMS ~1), vLLM's every parameter uniform in [-1e-3, 1e-3] (tiny activations). A GEMM held by the
chip's power limit runs slower on bits that toggle more.

Data (`DATA`): "normal" (weights N(0, 0.02), inputs N(0, 1): ours), "uniform" (weights U(-1e-3, 1e-3), inputs
N(0, 1) x U(-1e-3, 1e-3): a normed hidden state times vLLM's norm weights), "zeros" (the floor). The figure to
read is each data's sustained ms per layer against "normal"'s, and the clocks beside them.

    python -m benchmarks.gpu.gemm_power                                     # 1,248 and 4,224 rows, 3 s sustained
    python -m benchmarks.gpu.gemm_power --tokens 1248 --seconds 5 --data normal,uniform
    python -m benchmarks.gpu.gemm_power --tokens 4096,4216,4224 --data normal --kernels   # + cuBLAS's kernel per GEMM

`--kernels` records the kernel cuBLAS runs for each projection at each row count (torch.profiler, one call each):
a padded piecewise bucket (4,224 rows) may get another kernel than the exact size (4,216) vLLM runs eagerly.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from typing import Any

# one Llama-3.1-8B layer's projections (out features, in features): qkv, o, gate+up, down
LAYER_SHAPES: dict[str, tuple[int, int]] = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                                            "down": (4096, 14336)}
DATA: tuple[str, ...] = ("normal", "uniform", "zeros")
VLLM_RANGE = 1e-3  # vLLM's dummy loader: every parameter uniform in [-1e-3, 1e-3]


def layer_flops(tokens: int) -> int:
    """FLOPs of one layer's four projections on `tokens` rows."""
    return sum(2 * tokens * n * k for n, k in LAYER_SHAPES.values())


def fill(torch: Any, data: str, shape: tuple[int, ...], is_weight: bool, device: str, generator: Any) -> Any:
    """A bf16 tensor of `shape` drawn as `data` says (DATA), weights or inputs."""
    if data not in DATA:
        raise ValueError(f"data must be one of {', '.join(DATA)}, got {data!r}")
    if data == "zeros":
        return torch.zeros(shape, dtype=torch.bfloat16, device=device)
    if data == "normal":
        t = torch.randn(shape, generator=generator, device=device) * (0.02 if is_weight else 1.0)
    elif is_weight:
        t = (torch.rand(shape, generator=generator, device=device) * 2 - 1) * VLLM_RANGE
    else:
        scale = (torch.rand(shape[-1], generator=generator, device=device) * 2 - 1) * VLLM_RANGE  # the norm's weights
        t = torch.randn(shape, generator=generator, device=device) * scale
    return t.to(torch.bfloat16)


class Sampler:
    """SM clock (MHz) and board power (W) of GPU 0 every `period_s`, in a thread, through pynvml (None without)."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s, self.clocks, self.watts = period_s, [], []
        self._stop = threading.Event()
        try:
            import pynvml
            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # no pynvml or no NVML: the times still stand
            self._nvml = self._handle = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            n = self._nvml
            self.clocks.append(n.nvmlDeviceGetClockInfo(self._handle, n.NVML_CLOCK_SM))
            self.watts.append(n.nvmlDeviceGetPowerUsage(self._handle) / 1000)
            time.sleep(self.period_s)

    def __enter__(self) -> Sampler:
        if self._nvml is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def summary(self) -> dict[str, float | None]:
        half = len(self.clocks) // 2  # the second half: after the clocks settle
        return {"sm_mhz_median": statistics.median(self.clocks[half:]) if self.clocks[half:] else None,
                "watts_median": statistics.median(self.watts[half:]) if self.watts[half:] else None}


def kernel_names(torch: Any, fn: Any) -> list[str]:
    """The CUDA kernels one call of `fn` runs, in order (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
            and e.name and not e.name.startswith(("Memcpy", "Memset"))]


def run_case(torch: Any, data: str, tokens: int, seconds: float, reps: int = 5,
             kernels: bool = False) -> dict[str, Any]:
    """One data kind at one row count: the layer's four GEMMs as a burst (`reps` after two warm-ups, the host
    enqueueing behind a sleep kernel, as `PiecewiseGraphs.tune` times) and sustained for `seconds` (the last half
    timed), with the clocks sampled over the sustained run."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = {k: fill(torch, data, shape, True, "cuda", gen) for k, shape in LAYER_SHAPES.items()}
    inputs = {k: fill(torch, data, (tokens, shape[1]), False, "cuda", gen) for k, shape in LAYER_SHAPES.items()}

    def layer() -> None:
        for k in LAYER_SHAPES:
            torch.nn.functional.linear(inputs[k], weights[k])

    for _ in range(2):
        layer()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(20_000_000)
    begin.record()
    for _ in range(reps):
        layer()
    end.record()
    end.synchronize()
    burst_ms = begin.elapsed_time(end) / reps
    with Sampler() as sampler:
        started, timed, count = time.perf_counter(), None, 0
        while time.perf_counter() - started < seconds:
            if timed is None and time.perf_counter() - started >= seconds / 2:
                begin.record()
                timed, count = True, 0
            for _ in range(8):
                layer()
            count += 8
            if count % 64 == 0:  # keep the host within ~64 layers of the GPU
                torch.cuda.synchronize()
        end.record()
        end.synchronize()
    sustained_ms = begin.elapsed_time(end) / count
    flops = layer_flops(tokens)
    names = {k: kernel_names(torch, lambda k=k: torch.nn.functional.linear(inputs[k], weights[k]))
             for k in LAYER_SHAPES} if kernels else None
    return {**({"kernels": names} if names is not None else {}),
            "data": data, "tokens": tokens, "burst_ms": round(burst_ms, 4), "sustained_ms": round(sustained_ms, 4),
            "burst_tflops": round(flops / burst_ms / 1e9, 1), "sustained_tflops": round(flops / sustained_ms / 1e9, 1),
            **sampler.summary()}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: each case, and its sustained time over "normal"'s at the same rows."""
    base = {r["tokens"]: r["sustained_ms"] for r in rows if r["data"] == "normal"}
    lines = ["| data | rows | burst ms / layer | sustained ms / layer | sustained TFLOP/s | / normal | SM MHz | W |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['sustained_ms'] / base[r['tokens']]:.3f}" if r["tokens"] in base else "-"
        lines.append(f"| {r['data']} | {r['tokens']} | {r['burst_ms']:.3f} | {r['sustained_ms']:.3f} | "
                     f"{r['sustained_tflops']:.0f} | {ratio} | {r['sm_mhz_median'] or '-'} | {r['watts_median'] or '-'} |")
    named = [r for r in rows if r.get("kernels")]
    if named:
        lines += ["", "| rows | " + " | ".join(LAYER_SHAPES) + " |", "|---|" + "---|" * len(LAYER_SHAPES)]
        lines += [f"| {r['tokens']} | " + " | ".join(", ".join(r["kernels"][k]) for k in LAYER_SHAPES) + " |"
                  for r in named if r["data"] == named[0]["data"]]
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected row counts >= 1, got {text!r}")
    return values


def _data_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [v for v in values if v not in DATA]
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"expected some of {', '.join(DATA)}, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=_int_list, default=[1248, 4224], help="rows per GEMM (comma list)")
    parser.add_argument("--data", type=_data_list, default=list(DATA), help=f"comma list of {', '.join(DATA)}")
    parser.add_argument("--seconds", type=float, default=3.0, help="each sustained run's length (the last half timed)")
    parser.add_argument("--kernels", action="store_true",
                        help="also record the kernel cuBLAS runs for each projection (torch.profiler)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm import tqdm

    from benchmarks.gpu.common import save

    if not torch.cuda.is_available():
        print("gemm_power: needs a CUDA GPU", file=sys.stderr)
        return 2
    cases = [(d, t) for t in args.tokens for d in args.data]
    rows = [run_case(torch, d, t, args.seconds, kernels=args.kernels) for d, t in tqdm(cases, desc="gemm_power", unit="case")]
    print(table(rows))
    save("gemm_power", {"layer_shapes": LAYER_SHAPES, "seconds": args.seconds, "cases": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
