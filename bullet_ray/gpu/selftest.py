"""`python -m bullet_ray.gpu.selftest` (also `bullet-ray doctor`): can this machine split its GPU's SMs?

Prints the capability report. On a GPU with green contexts it then measures, on one complementary split
(--decode-sms for decode, the rest for prefill): a compute-bound bf16 GEMM on each side alone and both
together, against a control of two partitions that overlap (disjoint sides slow each other little:
shared power, L2 and memory; overlapping ones nearly double); the CPU cost of select(); and whether
kernels alternating between two ladder entries' streams leave the GPU idle (gap per switch). With
nvcc present it also checks which SMs each side's kernels ran on. It also reports what `engine.prefill_gemm:
cublaslt` would find (torch's libcublasLt, the choices' cache). Without a GPU it prints the reason, "no GPU: nothing
to measure", and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

GEMM_SHAPE = (4096, 4096, 14336)  # prefill-like: tokens x hidden @ hidden x intermediate


def gemm_ms(streams: list[Any], iters: int = 20, shape: tuple[int, int, int] = GEMM_SHAPE) -> list[float]:
    """Median ms of one bf16 GEMM on each stream, all streams busy at once (a GEMM each per round)."""
    import torch

    m, k, n = shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in streams]
    torch.cuda.synchronize()
    for s, w in zip(streams, ws):
        with torch.cuda.stream(s):
            for _ in range(3):
                a @ w
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
              for _ in streams]
    for i in range(iters):
        for s, w, ev in zip(streams, ws, events):
            with torch.cuda.stream(s):
                ev[i][0].record()
                a @ w
                ev[i][1].record()
    torch.cuda.synchronize()
    return [statistics.median(b.elapsed_time(e) for b, e in ev[iters // 4: iters - iters // 4]) for ev in events]


def switch_cost(partitioner: Any, side: str = "decode", num_kernels: int = 200) -> dict[str, Any]:
    """CPU cost of select() and SplitSwitch.maybe_switch(); GPU time of small GEMMs alternating between the
    streams of entries 0 and 1 (serialized like steps) against all on one stream: the idle gap per switch."""
    import numpy as np
    import torch

    from bullet_ray.gpu.switch import SplitSwitch

    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        partitioner.select(i & 1)
    select_us = (time.perf_counter() - t0) / n * 1e6
    sw = SplitSwitch(np.zeros(4, dtype=np.int64), partitioner.ladder)
    sw.reset(0)
    t0 = time.perf_counter()
    for i in range(n // 2):
        sw.slots[0] = (i + 1) & 1  # the controller's write, then both sides follow
        sw.maybe_switch("prefill")
        sw.maybe_switch("decode")
    maybe_switch_us = (time.perf_counter() - t0) / n * 1e6
    partitioner.select(0)
    s0, s1 = partitioner.stream(0, side), partitioner.stream(1, side)
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) for _ in range(6)]  # rotate past L2

    def run(streams: list[Any]) -> float:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(streams[0])
        prev = streams[0]
        for i in range(num_kernels):
            s = streams[i % len(streams)]
            if s is not prev:
                s.wait_stream(prev)  # one after another, as steps are
            with torch.cuda.stream(s):
                a @ ws[i % len(ws)]
            prev = s
        streams[0].wait_stream(prev)
        end.record(streams[0])
        end.synchronize()
        return start.elapsed_time(end)

    for _ in range(2):
        run([s0]), run([s1]), run([s0, s1])
    same0 = statistics.median(run([s0]) for _ in range(5))
    same1 = statistics.median(run([s1]) for _ in range(5))
    alternating = statistics.median(run([s0, s1]) for _ in range(5))
    expected = (same0 + same1) / 2  # half the kernels on each entry, no gap
    return {"select_cpu_us": round(select_us, 3), "maybe_switch_cpu_us": round(maybe_switch_us, 3),
            "num_kernels": num_kernels, "entry0_same_stream_ms": round(same0, 3),
            "entry1_same_stream_ms": round(same1, 3), "alternating_ms": round(alternating, 3),
            "gpu_gap_per_switch_us": round((alternating - expected) / num_kernels * 1e3, 2),
            "entries": [partitioner.ladder[0].__dict__, partitioner.ladder[1].__dict__]}


def measure_pair(decode_sms: int) -> dict[str, Any]:
    """One split, both sides in this process: GEMM alone / together, overlapping control, SM ids."""
    import torch

    from bullet_ray.gpu import probe
    from bullet_ray.gpu.partition import make_partitioner

    torch.zeros(1, device="cuda")
    pair = make_partitioner("green", "both", 0, [decode_sms, decode_sms + 16])
    control = make_partitioner("green", "decode", 0, [decode_sms])  # a second group over the same SMs
    try:
        d, p, c = pair.stream(0, "decode"), pair.stream(0, "prefill"), control.stream(0, "decode")
        alone = [gemm_ms([d])[0], gemm_ms([p])[0]]
        together = gemm_ms([d, p])
        overlap = gemm_ms([d, c])
        result: dict[str, Any] = {
            "split": pair.ladder[0].__dict__,
            "alone_ms": {"decode": alone[0], "prefill": alone[1]},
            "together_ms": {"decode": together[0], "prefill": together[1]},
            "slowdown_together": {"decode": round(together[0] / alone[0] - 1, 3),
                                  "prefill": round(together[1] / alone[1] - 1, 3)},
            "overlap_control_ms": overlap,
            "overlap_control_slowdown": [round(t / alone[0] - 1, 3) for t in overlap],
        }
        result["is_disjoint"] = max(result["slowdown_together"].values()) < 0.5 * min(result["overlap_control_slowdown"])
        if probe.available():
            ds, ps, cs = probe.sm_ids(d), probe.sm_ids(p), probe.sm_ids(c)
            result["sm_ids"] = {"decode_count": len(ds), "prefill_count": len(ps), "shared_decode_prefill": len(ds & ps),
                                "control_same_as_decode": cs == ds}
        result["switch"] = switch_cost(pair)
        return result
    finally:
        torch.cuda.synchronize()
        pair.close()
        control.close()


def prefill_gemm_report(has_gpu: bool) -> dict[str, Any]:
    """What `engine.prefill_gemm: cublaslt` would find: its choices' cache (file, entries) and, on a GPU, torch's
    libcublasLt (its version, or why it cannot be opened)."""
    from bullet_ray.engine import lt_gemm

    path = lt_gemm.cache_path()
    out: dict[str, Any] = {"cache": str(path) if path else "off", "cached_choices": len(lt_gemm.load_cache(path))}
    if has_gpu:
        try:
            lt = lt_gemm.LtLib.open(workspace_bytes=1 << 20)
            out["cublaslt"] = lt.version
            lt.close()
        except Exception as e:  # noqa: BLE001 - reported, not raised: the doctor says what is missing
            out["cublaslt"] = f"unavailable: {e}"
    return out


def print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.gpu.selftest",
                                     description="Report SM-partition capabilities; on a GPU, measure one split "
                                                 "(disjointness, overlap control, switch cost).")
    parser.add_argument("--decode-sms", type=int, default=32, help="decode SMs of the measured split (default 32)")
    parser.add_argument("--out", default=None, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    from bullet_ray.gpu import nvml, smctl

    caps = smctl.capability_report(0)
    report: dict[str, Any] = {"capabilities": caps.as_dict(), "nvml": nvml.snapshot(0)}
    print("SM-partition capabilities")
    print_table([("driver", str(caps.driver_version or "-")), ("SMs", str(caps.sm_count or "-")),
                 ("green contexts", "yes" if caps.green_ctx_supported else "no"),
                 ("granularity", f">= {caps.min_partition_sms} SMs in steps of {caps.partition_alignment}"
                  if caps.green_ctx_supported else "-"), ("reason", caps.reason or "-")])
    gemm = report["prefill_gemm"] = prefill_gemm_report(caps.has_gpu)
    print("engine.prefill_gemm: cublaslt")
    print_table([("libcublasLt", str(gemm.get("cublaslt", "- (no GPU)"))),
                 ("choices' cache", f"{gemm['cache']} ({gemm['cached_choices']} entries)")])
    if not caps.has_gpu:
        print("no GPU: nothing to measure")
    elif not caps.green_ctx_supported:
        print("green contexts unsupported: nothing to measure (the mps or none backend applies)")
    else:
        m = measure_pair(args.decode_sms)
        report["measurement"] = m
        sd, sw = m["slowdown_together"], m["switch"]
        print(f"split {m['split']['decode_sms']} decode / {m['split']['prefill_sms']} prefill SMs, bf16 GEMM "
              f"{'x'.join(map(str, GEMM_SHAPE))}")
        print_table([
            ("decode alone / together ms", f"{m['alone_ms']['decode']:.3f} / {m['together_ms']['decode']:.3f} "
                                           f"(+{sd['decode']:.0%})"),
            ("prefill alone / together ms", f"{m['alone_ms']['prefill']:.3f} / {m['together_ms']['prefill']:.3f} "
                                            f"(+{sd['prefill']:.0%})"),
            ("overlapping control", " / ".join(f"+{x:.0%}" for x in m["overlap_control_slowdown"])),
            ("disjoint", str(m["is_disjoint"])),
            ("SM ids", json.dumps(m.get("sm_ids", "probe unavailable (no nvcc)"))),
            ("select() CPU us", str(sw["select_cpu_us"])),
            ("maybe_switch() CPU us", str(sw["maybe_switch_cpu_us"])),
            ("GPU gap per switch us", str(sw["gpu_gap_per_switch_us"])),
        ])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
