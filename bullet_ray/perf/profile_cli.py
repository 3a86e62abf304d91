"""`bullet-ray profile`: measure a performance profile of one (device, model) and write it as JSON.

    bullet-ray profile --model dummy:llama-3.1-8b --device cuda --out bullet_ray/perf/profiles
    bullet-ray profile --model dummy:tiny-llama --device cpu --out /tmp/profiles     # CI: no ladder

The GPU sweep (bullet_ray.perf.sweep) runs every ladder entry's prefill and decode steps alone and with the
other side busy; the CPU sweep runs the same steps on one entry. The fitted calibration, the samples and
the fit's relative errors go into the file with the device, date and command (docs/policy.md). The engine
loads the file whose device, model architecture and dtype match (bullet_ray.perf.loading).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import sys
import time
from typing import Any

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure the performance model's profile of a device and model",
                              description="Sweep prefill tokens x decode batch x context x SM ladder entries, "
                                          "alone and with the other side busy, fit the calibration (on a GPU "
                                          "the bandwidth curve's shape from the decode steps first) and write "
                                          "a JSON profile the engine loads at start.")
    p.add_argument("--model", default="dummy:llama-3.1-8b", help="model source (default dummy:llama-3.1-8b)")
    p.add_argument("--name", default=None, help="model name in the profile (default: from --model)")
    p.add_argument("--device", default="cuda", help="cuda (default; the ladder, green contexts) or cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 on cuda, float32 on cpu (default)")
    p.add_argument("--out", default=".", help="folder (or .json file) to write the profile to")
    p.add_argument("--quick", action="store_true", help="a short sweep (smoke test of the GPU path)")
    p.add_argument("--enforce-eager", action="store_true", help="decode without CUDA graphs")
    p.add_argument("--entries", default=None, help="ladder indexes to sweep, in this order, e.g. 6,0,12,3,9 "
                                                   "(default: all)")
    p.add_argument("--decode-sm-counts", default=None,
                   help="the ladder to sweep, as the engine's decode_sm_counts: decode SM counts, comma-separated and "
                        "ascending, e.g. 8,16,24 (cuda only; default: the engine's default ladder, 16 ... 112 on "
                        "132 SMs); profile the ladder you serve with")
    p.add_argument("--prefill-gemm", default="auto", choices=["auto", "cublas", "cublaslt", "cublaslt-all"],
                   help="the prefill side's projection GEMMs, as the engine's prefill_gemm: profile with the GEMM you "
                        "serve with (cublaslt: cuBLASLt's algorithms tuned per partition at start, cuda only; auto, "
                        "the engine's default: cublaslt on a GPU in bfloat16, cublas otherwise)")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="stop starting new ladder entries when the next one would end past this many seconds "
                        "from the start (the profile keeps what was measured)")
    return p


def command_of(args: argparse.Namespace) -> str:
    """The `bullet-ray profile` command these arguments make, for the profile's provenance: built from the parsed
    arguments, not sys.argv (a script that calls `run`, e.g. benchmarks.gpu.profile_h100, has other argv)."""
    parts = ["bullet-ray profile"]
    for key, value in vars(args).items():
        if key in ("command", "func") or value is None or value is False or callable(value):
            continue
        flag = "--" + key.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


def _model_name(source: str) -> str:
    """"llama-3.1-8b" for dummy:llama-3.1-8b; a folder's or a config file's own name otherwise."""
    name = source.split(":", 1)[1] if source.startswith("dummy:") else source
    name = name.rstrip("/").split("/")[-1]
    return name[:-5] if name.endswith(".json") else name


def run(args: argparse.Namespace) -> int:
    from bullet_ray.errors import BulletRayError

    try:
        return _run(args)
    except BulletRayError as e:
        print(f"bullet-ray profile: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bullet_ray.config import parse_ladder, resolve_prefill_gemm
    from bullet_ray.errors import ConfigError
    from bullet_ray.perf.model import PerfModel, profile_fit, refine_bandwidth_curve
    from bullet_ray.perf.profile import Profile, model_fingerprint, save_profile
    from bullet_ray.perf.sweep import Bench, SweepPlan, decode_points, prefill_points

    is_gpu = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if is_gpu else "float32")
    args.prefill_gemm = resolve_prefill_gemm(args.prefill_gemm, is_gpu, dtype, "bullet")  # the sweep's partitions
    if args.prefill_gemm != "cublas" and not (is_gpu and dtype == "bfloat16"):
        raise ConfigError("--prefill-gemm", f"{args.prefill_gemm} runs bf16 cuBLASLt GEMMs on a GPU (device "
                          f"{args.device}, dtype {dtype})")
    counts = None
    if args.decode_sm_counts is not None:
        if not is_gpu:
            raise ConfigError("--decode-sm-counts", f"the split ladder is a GPU's (device {args.device} has none)")
        try:
            counts = parse_ladder(args.decode_sm_counts)
        except ValueError as e:
            raise ConfigError("--decode-sm-counts", str(e)) from None
    args.decode_sm_counts = counts
    plan = SweepPlan.gpu(args.quick) if is_gpu else SweepPlan.cpu(args.quick)
    bench = Bench(args.model, args.device, dtype, use_graphs=is_gpu and not args.enforce_eager,
                  max_batch=max(plan.decode_batches))
    if is_gpu:
        gpu, ladder, partitioner = _gpu_ceilings(bench, args)
    else:
        gpu, ladder, partitioner = _cpu_ceilings(bench), [1], None
    pre, dec = prefill_points(plan, bench.capacity_tokens), decode_points(plan, bench.capacity_tokens)
    entries = list(range(len(ladder)))
    if args.entries:
        entries = [int(i) for i in args.entries.split(",")]
    router, gemm_note = None, ""
    if args.prefill_gemm != "cublas":
        router, gemm_note = _route_prefill_gemm(bench, partitioner, args, max(s * n for s, n, _ in pre), entries)
    total = len(entries) * len(plan.busy) * (len(pre) + len(dec))
    samples: list = []
    started, slowest = time.monotonic(), 0.0
    done: list[int] = []
    try:
        with tqdm(total=total, desc="profile", unit="step") as bar:
            for index in entries:
                elapsed = time.monotonic() - started
                if args.max_seconds is not None and done and elapsed + 1.2 * slowest > args.max_seconds:
                    print(f"stopping after entries {done}: the next would end past --max-seconds {args.max_seconds}")
                    break
                t0 = time.monotonic()
                samples += _sweep_entry(bench, plan, partitioner, index, gpu, pre, dec, bar)
                slowest = max(slowest, time.monotonic() - t0)
                done.append(index)
    finally:
        if router is not None:
            router.close()
    if is_gpu:  # the bandwidth curve's shape from the decode steps themselves, and the calibration on it
        gpu, calibration = refine_bandwidth_curve(bench.cfg, gpu, samples, bench.dtype.itemsize)
        model = PerfModel(bench.cfg, gpu, calibration, dtype_bytes=bench.dtype.itemsize)
    else:
        model = PerfModel(bench.cfg, gpu, dtype_bytes=bench.dtype.itemsize)
        model.calibration = model.fit(samples)
    fit = profile_fit(model, samples)
    if partitioner is not None:
        partitioner.close()
    profile = Profile(gpu, {"name": args.name or _model_name(args.model), **model_fingerprint(bench.cfg)}, dtype,
                      [e for e in ladder] if is_gpu else [1], model.calibration, samples,
                      datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      command_of(args),
                      "measured", f"ladder entries swept: {done}; plan {plan}{gemm_note}", fit)
    path = save_profile(profile, args.out)
    print(f"wrote {path}")
    print(f"calibration {model.calibration.to_dict()}")
    print(f"fit {fit}")
    return 0


def _route_prefill_gemm(bench: Any, partitioner: Any, args: argparse.Namespace, max_tokens: int,
                        entries: list[int]) -> tuple[Any, str]:
    """The bench model's projections through cuBLASLt's algorithms tuned on each prefill side where cuBLAS's grid
    wastes SM-rounds (bullet_ray.engine.lt_gemm, as the engine's prefill worker); (the router, the profile note)."""
    from tqdm import tqdm

    from bullet_ray.engine import lt_gemm

    torch = bench.torch
    device = torch.device(args.device)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    places = lt_gemm.tuned_places([(e.index, e.prefill_sms, partitioner.stream(e.index, "prefill"))
                                   for e in partitioner.ladder if e.index in entries], sm_count)
    routed = lt_gemm.tune_and_route(bench.model, places, args.prefill_gemm, max_tokens, device, sm_count,
                                    progress=lambda it: tqdm(it, desc="prefill GEMM algorithms"))
    if routed is None:
        return None, f"; prefill_gemm {args.prefill_gemm}: nothing to tune"
    router, report = routed
    print(f"prefill GEMMs: {report['kept']} of {report['points']} points kept a cuBLASLt algorithm "
          f"(median speedup {report['kept_speedup_median']})")
    return router, (f"; prefill_gemm {args.prefill_gemm}: {report['kept']} of {report['points']} points kept an "
                    f"algorithm, median speedup {report['kept_speedup_median']}")


def _cpu_ceilings(bench: Any) -> Any:
    from bullet_ray.perf.roofline import GpuSpec
    from bullet_ray.perf.sweep import gemm_tflops, gemv_gbs

    torch = bench.torch
    tflops = gemm_tflops(torch, "cpu", bench.dtype, 512)
    gbs = gemv_gbs(torch, "cpu", bench.dtype, rows=8, k=1024, n=4096, copies=8)
    return GpuSpec("cpu", 1, round(tflops, 4), round(gbs, 2), 0.5, 2.0)


def _gpu_ceilings(bench: Any, args: argparse.Namespace) -> Any:
    """Whole-GPU GEMM and GEMV, GEMV on each entry's decode side, the bandwidth curve; the partitioner."""
    from bullet_ray.gpu.partition import make_partitioner
    from bullet_ray.perf.roofline import GpuSpec
    from bullet_ray.perf.sweep import fit_bandwidth_curve, gemm_tflops, gemv_gbs

    torch = bench.torch
    props = torch.cuda.get_device_properties(torch.device(args.device))
    sm_count = props.multi_processor_count
    device_index = torch.device(args.device).index or 0
    partitioner = make_partitioner("green", "both", device_index, args.decode_sm_counts)
    ladder = [e.decode_sms for e in partitioner.ladder]
    tflops = gemm_tflops(torch, args.device, torch.bfloat16, 8192)
    points = {sm_count: gemv_gbs(torch, args.device, torch.bfloat16)}
    for entry in partitioner.ladder:
        points[entry.decode_sms] = gemv_gbs(torch, args.device, torch.bfloat16,
                                            stream=partitioner.stream(entry.index, "decode"))
    sat, knee = fit_bandwidth_curve(sm_count, points)
    print(f"GEMM {tflops:.0f} TFLOP/s; GEMV GB/s by SMs {dict(sorted(points.items()))}; saturation {sat} SMs, "
          f"knee {knee}")
    return GpuSpec(props.name, sm_count, round(tflops, 1), round(points[sm_count], 1), sat, knee), ladder, partitioner


def _sweep_entry(bench: Any, plan: Any, partitioner: Any, index: int, gpu: Any, pre: list, dec: list,
                 bar: Any) -> list:
    """Every point on ladder entry `index`: alone first (their times size the busy runs), then busy."""
    from bullet_ray.perf.sweep import LONG_STEP_S, _time_s, sample_of

    torch = bench.torch
    on_gpu = partitioner is not None
    if on_gpu:
        partitioner.select(index)
        entry = partitioner.ladder[index]
        streams = {"prefill": partitioner.stream(index, "prefill"), "decode": partitioner.stream(index, "decode")}
        sms = {"prefill": entry.prefill_sms, "decode": entry.decode_sms}
    else:
        streams, sms = {"prefill": None, "decode": None}, {"prefill": 1, "decode": 1}
    points = [("prefill", bench.batch(s, n, c)) for s, n, c in pre] + [("decode", bench.batch(b, 1, c - 1))
                                                                       for b, c in dec]
    # the other side's load while busy (on the far half of the pool): a 512-token prefill / a decode of
    # 64 x 1024 (steps of ~10-60 ms, so a queue of them covers the measured step without minutes of waiting)
    half = bench.num_blocks // 2
    other_batch = {"decode": bench.batch(1, min(512, bench.capacity_tokens // 4), 0, half),
                   "prefill": bench.batch(min(64, max(plan.decode_batches)), 1, 1023, half)}
    out, alone_s = [], {}

    def on(side: str, fn: Any) -> Any:
        def run() -> Any:
            if streams[side] is None:
                return fn()
            with torch.cuda.stream(streams[side]):
                return fn()
        return run

    def sync(side: str) -> Any:
        return (lambda: streams[side].synchronize()) if streams[side] is not None else (lambda: None)

    other_s = {}
    device_sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    if True in plan.busy:
        for side, other in (("prefill", "decode"), ("decode", "prefill")):
            other_s[side] = _time_s(on(other, bench.step_fn(other_batch[side], index)), sync(other), 3, 1)
    for busy in plan.busy:
        for i, (phase, batch) in enumerate(points):
            fn = on(phase, bench.step_fn(batch, index))
            if not busy:
                t = _time_s(fn, sync(phase), plan.repeats, plan.warmup, best=not on_gpu)
                alone_s[i] = t
            else:
                # queue enough of the other side's steps on its stream to outlast every timed repeat, then
                # time the step (the first run is a warm-up) while they run
                other = "decode" if phase == "prefill" else "prefill"
                other_fn = on(other, bench.step_fn(other_batch[phase], index))
                alone = alone_s.get(i, 0.01)
                repeats = 3 if alone > LONG_STEP_S else plan.repeats
                needed = (repeats + 1) * alone * 1.5 + 0.01
                for _ in range(min(2000, math.ceil(needed / max(other_s[phase], 1e-4)) + 1)):
                    other_fn()
                times = [_time_s(fn, sync(phase), 1, 0) for _ in range(repeats + 1)][1:]
                device_sync()
                t = sorted(times)[len(times) // 2]
            out.append(sample_of(phase, batch, sms[phase], busy, t))
            bar.update(1)
    return out
