"""SM partitions on the GPU, in one run: capabilities; which SMs each side's kernels run on; SM-count scaling
of a prefill-like GEMM and a decode-like GEMV on both sides of every ladder entry; two-process disjointness
under MPS (two clients taking the two sides of one split, together vs alone, vs an overlapping control);
switch cost (CPU latency of select(), GPU gap when kernels alternate between entries' streams).

    python -m benchmarks.gpu.sm_partition [--ladder 16,24,...] [--split 32] [--skip-mps]

Writes sm_partition_<gpu>.json with device, date and command to $OUT (else benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.gpu.common import save

GEMM = (4096, 4096, 14336)  # prefill-like: tokens x hidden @ hidden x intermediate
GEMV = (64, 4096, 14336)  # decode-like: 64 rows @ the same weight, weights rotated past L2
GEMV_COPIES = 6  # 6 x 117 MB of weights >> 50 MB of L2


def _timed(fn: Any, stream: Any, iters: int, warmup: int = 3) -> float:
    """Median ms of fn() on `stream`, CUDA events, after warm-up."""
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for b, e in ev:
            b.record()
            fn()
            e.record()
    torch.cuda.synchronize()
    return statistics.median(b.elapsed_time(e) for b, e in ev)


def _matmul(shape: tuple[int, int, int], copies: int = 1) -> Any:
    m, k, n = shape
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(k, n, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
    state = {"i": 0}

    def run() -> torch.Tensor:
        state["i"] = (state["i"] + 1) % copies
        return a @ ws[state["i"]]

    return run


def tflops(ms: float) -> float:
    return round(2 * GEMM[0] * GEMM[1] * GEMM[2] / (ms / 1e3) / 1e12, 1)


def gbs(ms: float) -> float:
    m, k, n = GEMV
    return round((k * n + m * k + m * n) * 2 / (ms / 1e3) / 1e9, 1)


def sm_id_check(p: Any) -> dict[str, Any]:
    """Per entry: SMs used by each side, overlap, union; and whether decode groups are nested."""
    from bullet_ray.gpu import probe

    if not probe.available():
        return {"skipped": "no nvcc for the SM-id probe"}
    full = probe.sm_ids(torch.cuda.current_stream())
    rows, decode_sets = [], []
    for e in p.ladder:
        d, q = probe.sm_ids(p.stream(e.index, "decode")), probe.sm_ids(p.stream(e.index, "prefill"))
        decode_sets.append(d)
        rows.append({"decode_sms": e.decode_sms, "decode_used": len(d), "prefill_sms": e.prefill_sms,
                     "prefill_used": len(q), "shared": len(d & q), "union": len(d | q)})
    nested = all(a <= b for a, b in zip(decode_sets, decode_sets[1:]))
    return {"full_gpu_used": len(full), "entries": rows, "decode_groups_nested": nested,
            "decode_sm_ids_first_entry": sorted(decode_sets[0])}


def scaling(p: Any) -> dict[str, Any]:
    gemm, gemv = _matmul(GEMM), _matmul(GEMV, GEMV_COPIES)
    cur = torch.cuda.current_stream()
    out: dict[str, Any] = {"gemm_shape": GEMM, "gemv_shape": GEMV,
                           "full_gpu": {"gemm_tflops": tflops(_timed(gemm, cur, 20)),
                                        "gemv_gbs": gbs(_timed(gemv, cur, 60))}, "entries": []}
    for e in p.ladder:
        row: dict[str, Any] = {"decode_sms": e.decode_sms, "prefill_sms": e.prefill_sms}
        for side in ("decode", "prefill"):
            s = p.stream(e.index, side)
            row[f"{side}_gemm_tflops"] = tflops(_timed(gemm, s, 10))
            row[f"{side}_gemv_gbs"] = gbs(_timed(gemv, s, 40))
        out["entries"].append(row)
        print(f"  scaling {e.decode_sms:>3}/{e.prefill_sms:<3}: {row}", flush=True)
    return out


def child(side: str, split: int, overlap: bool, iters: int) -> None:
    """One MPS client: make the split, take `side` (control: the decode group, like the other client),
    say READY, wait for GO on stdin, run GEMMs, print RESULT <json>."""
    from bullet_ray.gpu import probe
    from bullet_ray.gpu.partition import make_partitioner

    torch.zeros(1, device="cuda")
    take = "decode" if overlap else side
    p = make_partitioner("green", take, 0, [split])  # type: ignore[arg-type]
    s = p.stream(0, take)
    gemm = _matmul(GEMM)
    _timed(gemm, s, 2)
    print("READY", flush=True)
    sys.stdin.readline()
    ms = _timed(gemm, s, iters, warmup=1)
    ids = sorted(probe.sm_ids(s)) if probe.available() else []
    print("RESULT " + json.dumps({"ms": ms, "sm_ids": ids, "sms": p.ladder[0].__dict__}), flush=True)
    p.close()


def two_process(split: int, iters: int = 40) -> dict[str, Any]:
    from bullet_ray.gpu.mps import MpsDaemon, require_mps

    mps = MpsDaemon(f"bench-sm-partition-{os.getpid()}")
    t0 = time.perf_counter()
    mps.start()
    start_s = time.perf_counter() - t0
    env = {**os.environ, **mps.env()}
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    require_mps(env)

    def run(sides: list[str], overlap: bool) -> list[dict[str, Any]]:
        procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.sm_partition", "--child", side, "--split",
                                   str(split), "--iters", str(iters)] + (["--overlap"] if overlap else []),
                                  env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                 for side in sides]
        for p in procs:  # all clients made their partitions and warmed up
            while (line := p.stdout.readline()) and not line.startswith("READY"):  # type: ignore[union-attr]
                pass
        for p in procs:
            p.stdin.write("GO\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        return [json.loads(line[7:]) for o in outs for line in o.splitlines() if line.startswith("RESULT ")]

    try:
        status = mps.status()
        d_alone, p_alone = run(["decode"], False)[0], run(["prefill"], False)[0]
        d_tog, p_tog = run(["decode", "prefill"], False)
        c_alone = run(["decode"], True)[0]
        c_tog = run(["decode", "prefill"], True)
    finally:
        mps.stop()
    shared = len(set(d_tog["sm_ids"]) & set(p_tog["sm_ids"])) if d_tog["sm_ids"] else None
    return {
        "split": d_tog["sms"], "mps_start_s": round(start_s, 2), "mps_server_pids": list(status.server_pids),
        "alone_ms": {"decode": d_alone["ms"], "prefill": p_alone["ms"]},
        "together_ms": {"decode": d_tog["ms"], "prefill": p_tog["ms"]},
        "slowdown_together": {"decode": round(d_tog["ms"] / d_alone["ms"] - 1, 3),
                              "prefill": round(p_tog["ms"] / p_alone["ms"] - 1, 3)},
        "sm_ids": {"decode_used": len(d_tog["sm_ids"]), "prefill_used": len(p_tog["sm_ids"]),
                   "shared_between_processes": shared, "decode_ids": d_tog["sm_ids"], "prefill_ids": p_tog["sm_ids"],
                   "note": "ids as each MPS client sees them (%smid; MPS may renumber them per client)"},
        "overlap_control_alone_ms": c_alone["ms"], "overlap_control_together_ms": [c["ms"] for c in c_tog],
        "overlap_control_slowdown": [round(c["ms"] / c_alone["ms"] - 1, 3) for c in c_tog],
        "overlap_control_shared_sms": len(set(c_tog[0]["sm_ids"]) & set(c_tog[1]["sm_ids"])) if c_alone["sm_ids"]
        else None,
        "method": "two MPS clients (own daemon, bullet_ray.gpu.mps); each makes the same split and takes one side "
                  "(control: both take the decode group); bf16 GEMM 4096x4096x14336 each, started together "
                  f"after both warmed up; median of {iters}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", choices=["decode", "prefill"], help=argparse.SUPPRESS)
    parser.add_argument("--overlap", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=40, help="GEMMs per process in the two-process test")
    parser.add_argument("--split", type=int, default=32, help="decode SMs of the two-process test (default 32)")
    parser.add_argument("--ladder", default=None, help="decode SM counts to scan (default: default_ladder)")
    parser.add_argument("--skip-mps", action="store_true", help="skip the two-process MPS test")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.split, args.overlap, args.iters)
        return 0
    from bullet_ray.gpu import nvml, smctl
    from bullet_ray.gpu.partition import default_ladder, make_partitioner
    from bullet_ray.gpu.selftest import measure_pair, switch_cost

    caps = smctl.capabilities(0)
    print(caps, flush=True)
    counts = [int(x) for x in args.ladder.split(",")] if args.ladder else default_ladder(caps.sm_count,
                                                                                          caps.granularity)
    torch.zeros(1, device="cuda")
    result: dict[str, Any] = {"capabilities": caps.as_dict(), "nvml": nvml.snapshot(0), "ladder_asked": counts}
    p = make_partitioner("green", "both", 0, counts)
    result["ladder"] = [e.__dict__ for e in p.ladder]
    result["sm_ids"] = sm_id_check(p)
    print("sm ids:", json.dumps({k: v for k, v in result["sm_ids"].items() if k != "entries"}), flush=True)
    result["scaling"] = scaling(p)
    result["switch"] = switch_cost(p)
    print("switch:", result["switch"], flush=True)
    torch.cuda.synchronize()
    p.close()
    result["one_process_pair"] = measure_pair(args.split)
    if not args.skip_mps:
        result["two_process"] = two_process(args.split, args.iters)
    name = torch.cuda.get_device_name(0).split()[1].lower()
    save(f"sm_partition_{name}", result)
    f = result["scaling"]["full_gpu"]
    print(f"\nfull GPU: GEMM {f['gemm_tflops']} TFLOP/s, GEMV {f['gemv_gbs']} GB/s")
    print(f"{'decode':>6} {'prefill':>7} | {'dec GEMM':>8} {'dec GEMV':>8} | {'pre GEMM':>8} {'pre GEMV':>8}")
    for r in result["scaling"]["entries"]:
        print(f"{r['decode_sms']:>6} {r['prefill_sms']:>7} | {r['decode_gemm_tflops']:>8} {r['decode_gemv_gbs']:>8} | "
              f"{r['prefill_gemm_tflops']:>8} {r['prefill_gemv_gbs']:>8}")
    one = result["one_process_pair"]
    print("one process pair:", one["slowdown_together"], "overlap control:", one["overlap_control_slowdown"],
          one.get("sm_ids"))
    if "two_process" in result:
        t = result["two_process"]
        print("two processes (MPS):", t["slowdown_together"], "overlap control:", t["overlap_control_slowdown"],
              t["sm_ids"], "control shared SMs:", t["overlap_control_shared_sms"])
    s = result["switch"]
    print(f"switch: select() {s['select_cpu_us']} us CPU, maybe_switch() {s['maybe_switch_cpu_us']} us CPU, "
          f"GPU gap {s['gpu_gap_per_switch_us']} us per switch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
