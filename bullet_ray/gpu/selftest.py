"""`python -m bullet_ray.gpu.selftest` (also `bullet-ray doctor`): can this machine split its GPU's SMs?

Prints the capability report. On a GPU it then runs a compute-bound bf16 GEMM on each side of a
complementary split, alone and together (two streams), and on an overlapping pair as a control: disjoint
sides slow each other down little (shared power, L2, memory), overlapping ones a lot. It also reports
the CPU cost of switching ladder entries. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _gemm_ms(streams: list[Any], iters: int = 20) -> list[float]:
    """Median ms per GEMM on each stream, all streams launched together."""
    import torch

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) for _ in streams]
    for s, w in zip(streams, ws):
        with torch.cuda.stream(s):
            a @ w
    torch.cuda.synchronize()
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
              for _ in streams]
    for i in range(iters):
        for s, w, ev in zip(streams, ws, events):
            ev[i][0].record(s)
            with torch.cuda.stream(s):
                a @ w
            ev[i][1].record(s)
    torch.cuda.synchronize()
    return [sorted(b.elapsed_time(e) for b, e in ev)[iters // 2] for ev in events]


def measure(decode_sms: int) -> dict[str, Any]:
    import torch

    from bullet_ray.gpu.partition import GreenPartitioner

    torch.zeros(1, device="cuda")
    pair = GreenPartitioner("both", 0, [decode_sms])
    d, p = pair.stream(0, "decode"), pair.stream(0, "prefill")
    alone = [_gemm_ms([d])[0], _gemm_ms([p])[0]]
    together = _gemm_ms([d, p])
    control = GreenPartitioner("decode", 0, [decode_sms])  # a second group over the same SMs as `d`
    overlap_alone = _gemm_ms([d])[0]
    overlap = _gemm_ms([d, control.stream(0, "decode")])
    start = time.perf_counter()
    for _ in range(1000):
        pair.select(0)
    select_us = (time.perf_counter() - start) / 1000 * 1e6
    entry = pair.ladder[0]
    pair.close()
    control.close()
    return {
        "split": {"decode_sms": entry.decode_sms, "prefill_sms": entry.prefill_sms},
        "alone_ms": alone, "together_ms": together,
        "slowdown_together": [round(t / a - 1, 3) for t, a in zip(together, alone)],
        "overlap_control_slowdown": [round(t / overlap_alone - 1, 3) for t in overlap],
        "is_disjoint": max(t / a - 1 for t, a in zip(together, alone)) < 0.5 * min(t / overlap_alone - 1 for t in overlap),
        "select_cpu_us": round(select_us, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.gpu.selftest", description=__doc__.split("\n")[0])
    parser.add_argument("--decode-sms", type=int, default=32, help="decode SMs of the tested split (default 32)")
    parser.add_argument("--out", default=None, help="also write the report as JSON to this file")
    args = parser.parse_args(argv)
    from bullet_ray.gpu import smctl

    report: dict[str, Any] = {}
    try:
        caps = smctl.capabilities(0)
        report["capabilities"] = caps.__dict__
        print(f"driver {caps.driver_version}, {caps.sm_count} SMs, green contexts: {caps.green_ctx_supported} "
              f"(partitions of >= {caps.min_partition_sms} SMs in steps of {caps.partition_alignment}) {caps.reason}")
        if caps.green_ctx_supported:
            report["measurement"] = measure(args.decode_sms)
            print(json.dumps(report["measurement"], indent=2))
    except smctl.NoDriverError as e:
        report["capabilities"] = {"reason": str(e)}
        print(f"no GPU: nothing to measure ({e})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
