"""SM partitions on the GPU: capabilities, SM-count scaling per ladder entry, two-process disjointness under
MPS, and switch cost. One run, one JSON (benchmarks/results/sm_partition_<gpu>.json).

    python -m benchmarks.gpu.sm_partition            (needs a CUDA GPU, nvidia-cuda-mps-control for part 3)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from tqdm import tqdm

from benchmarks.gpu.common import save, time_cuda

GEMM = (4096, 4096, 14336)  # prefill-like: tokens x hidden @ hidden x intermediate
GEMV = (64, 4096, 14336)  # decode-like: a batch of 64 rows


def gemm_fn(m: int, k: int, n: int, copies: int = 1):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % copies  # rotate weights past the L2 cache
        return a @ ws[state["i"]]

    return run


def scaling(counts: list[int]) -> list[dict]:
    from bullet_ray.gpu.partition import GreenPartitioner

    p = GreenPartitioner("both", 0, counts)
    gemm, gemv = gemm_fn(*GEMM), gemm_fn(*GEMV, copies=6)
    rows = []
    full_gemm, full_gemv = time_cuda(gemm), time_cuda(gemv)
    for e in tqdm(p.ladder, desc="ladder scaling"):
        row = {"decode_sms": e.decode_sms, "prefill_sms": e.prefill_sms}
        for side in ("decode", "prefill"):
            s = p.stream(e.index, side)
            ms = time_cuda(gemm, stream=s)
            row[f"{side}_gemm_tflops"] = round(2 * GEMM[0] * GEMM[1] * GEMM[2] / (ms / 1e3) / 1e12, 1)
            ms = time_cuda(gemv, stream=s)
            row[f"{side}_gemv_gbs"] = round(GEMV[1] * GEMV[2] * 2 / (ms / 1e3) / 1e9, 1)
        rows.append(row)
    p.close()
    return [{"full_gpu_gemm_tflops": round(2 * GEMM[0] * GEMM[1] * GEMM[2] / (full_gemm / 1e3) / 1e12, 1),
             "full_gpu_gemv_gbs": round(GEMV[1] * GEMV[2] * 2 / (full_gemv / 1e3) / 1e9, 1)}] + rows


def switch_cost(counts: list[int]) -> dict:
    """CPU cost of select(); GPU time of kernels alternating between two entries' streams vs one stream."""
    from bullet_ray.gpu.partition import GreenPartitioner

    p = GreenPartitioner("decode", 0, counts)
    n = 2000
    start = time.perf_counter()
    for i in range(n):
        p.select(i % 2)
    select_us = (time.perf_counter() - start) / n * 1e6
    gemv = gemm_fn(*GEMV, copies=6)
    s0, s1 = p.stream(0, "decode"), p.stream(1, "decode")
    iters = 200

    def same():
        with torch.cuda.stream(s0):
            for _ in range(iters):
                gemv()

    def alternating():
        prev = s0
        for i in range(iters):
            s = (s0, s1)[i % 2]
            s.wait_stream(prev)  # keep the kernels serialized, as steps are
            with torch.cuda.stream(s):
                gemv()
            prev = s
        s0.wait_stream(prev)

    def same_on(s):
        def run():
            with torch.cuda.stream(s):
                for _ in range(iters):
                    gemv()
        return run

    t0 = time_cuda(same_on(s0), iters=5, stream=s0)
    t1 = time_cuda(same_on(s1), iters=5, stream=s1)
    t_alt = time_cuda(alternating, iters=5, stream=s0)
    p.close()
    expected = (t0 + t1) / 2  # half the kernels on each entry, no gap
    return {"select_cpu_us": round(select_us, 2), "kernels": iters, "entry0_stream_ms": round(t0, 3),
            "entry1_stream_ms": round(t1, 3), "alternating_streams_ms": round(t_alt, 3),
            "gap_per_switch_us": round((t_alt - expected) / iters * 1e3, 2),
            "note": "decode side alternates between ladder entries 0 and 1 every kernel; gap = (alternating - "
                    "mean of the two single-entry runs) / kernels"}


def child(side: str, split: int, overlap: bool, start_at: float, iters: int) -> None:
    """One MPS client: run GEMMs on its side of split(split) and print the median ms."""
    from bullet_ray.gpu.partition import GreenPartitioner

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    take = "decode" if overlap else side  # the control: both processes take the same group
    p = GreenPartitioner(take, 0, [split])  # type: ignore[arg-type]
    s = p.stream(0, take)
    gemm = gemm_fn(*GEMM)
    with torch.cuda.stream(s):
        gemm()
    torch.cuda.synchronize()
    while time.time() < start_at:
        time.sleep(0.001)
    ms = time_cuda(gemm, iters=iters, warmup=2, stream=s)
    print(f"RESULT {ms:.4f}", flush=True)


def two_process(split: int) -> dict:
    from bullet_ray.gpu.mps import MpsDaemon

    mps = MpsDaemon(f"bench-{os.getpid()}")
    mps.start()
    env = {**os.environ, **mps.env()}
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)

    def run(sides: list[str], overlap: bool) -> list[float]:
        start_at = time.time() + 8.0
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.sm_partition", "--child", side,
                                   "--split", str(split), "--start-at", str(start_at), "--iters", "60"]
                                  + (["--overlap"] if overlap else []), env=env, stdout=subprocess.PIPE, text=True)
                 for side in sides]
        outs = [p.communicate(timeout=180)[0] for p in procs]
        return [float(line.split()[1]) for o in outs for line in o.splitlines() if line.startswith("RESULT")]

    try:
        alone = [run(["decode"], False)[0], run(["prefill"], False)[0]]
        together = run(["decode", "prefill"], False)
        control = run(["decode", "prefill"], True)
        control_alone = run(["decode"], True)[0]
    finally:
        mps.stop()
    return {"split_decode_sms": split,
            "alone_ms": {"decode": alone[0], "prefill": alone[1]},
            "together_ms": {"decode": together[0], "prefill": together[1]},
            "slowdown_together": {"decode": round(together[0] / alone[0] - 1, 3),
                                  "prefill": round(together[1] / alone[1] - 1, 3)},
            "overlap_control_alone_ms": control_alone,
            "overlap_control_together_ms": control,
            "overlap_control_slowdown": [round(c / control_alone - 1, 3) for c in control],
            "method": "two MPS clients; each makes the same split and takes one side (control: both take the "
                      "same group); a bf16 GEMM 4096x4096x14336 on each, started together"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    parser.add_argument("--split", type=int, default=32, help="decode SMs of the two-process test (default 32)")
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=60, help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ladder", default="16,32,48,64,80,96,112", help="decode SM counts to scan")
    parser.add_argument("--skip-mps", action="store_true", help="skip the two-process MPS test")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.split, args.overlap, args.start_at, args.iters)
        return 0
    from bullet_ray.gpu import smctl

    caps = smctl.capabilities(0)
    print(caps)
    counts = [int(x) for x in args.ladder.split(",")]
    result = {"capabilities": caps.__dict__, "scaling": scaling(counts), "switch": switch_cost(counts[:2])}
    if not args.skip_mps:
        result["two_process"] = two_process(args.split)
    save(f"sm_partition_{torch.cuda.get_device_name(0).split()[1].lower()}", result)
    for row in result["scaling"]:
        print(row)
    print(result["switch"])
    print(result.get("two_process"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
