"""The SM split over time: the real engine (bullet schedule, under MPS) on Poisson arrivals, once per split
policy, sampling the engine's split, decode step time and queues every 10 ms.

Dummy Llama-3.1-8B; prompts and outputs of random lengths (seeded); requests sent as token ids with
ignore_eos. Per policy: TTFT and TPOT percentiles, strict-SLO attainment (TTFT <= 0.5 s, TPOT <= 25 ms),
the number of split requests, and the trace; one PNG with the decode side's SMs, the decode step time and
the queues over time for every policy.

    python -m benchmarks.gpu.split_trace --policies slo,fixed --rate 12 --seconds 40
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from benchmarks.gpu.common import save
from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams

MODEL = "dummy:llama-3.1-8b"


def _workload(rate: float, seconds: float, seed: int, max_prompt: int = 2048) -> list[tuple[float, int, int]]:
    """(send time, prompt tokens, output tokens) of Poisson arrivals."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return out
        out.append((t, rng.randint(128, max_prompt), rng.randint(32, 320)))


def _one(engine: LLMEngine, start: float, send_s: float, prompt_len: int, out_len: int, seed: int) -> dict:
    time.sleep(max(0.0, start + send_s - time.monotonic()))
    rng = random.Random(seed)
    ids = [rng.randrange(engine.vocab_size // 2, engine.vocab_size) for _ in range(prompt_len)]
    sent = time.monotonic()
    first = last = None
    n = 0
    for out in engine.stream(ids, SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)):
        now = time.monotonic()
        n += len(out.token_ids_delta)
        if first is None and n:
            first = now
        last = now
    ttft = (first - sent) if first is not None else None
    tpot = ((last - first) / (n - 1)) if first is not None and last is not None and n > 1 else None
    return {"send_s": round(send_s, 4), "prompt": prompt_len, "output": n, "ttft_s": ttft, "tpot_s": tpot}


def run_policy(policy: str, rate: float, seconds: float, seed: int, model: str = MODEL,
               device: str = "cuda") -> dict[str, Any]:
    kv_gb = 30.0 if device.startswith("cuda") else 0.25
    cfg = EngineConfig(model=model, device=device, schedule="bullet", kv_cache_memory_gb=kv_gb, max_num_seqs=256,
                       max_num_batched_tokens=8192, split_policy=policy)
    trace: list[dict[str, Any]] = []
    with LLMEngine(cfg) as engine:
        warm = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engine.generate([[100 + i] * min(512, engine.max_model_len - 32) for i in range(32)], warm)  # graphs and kernels before timing
        stop = threading.Event()
        t0 = time.monotonic()

        def sample() -> None:
            while not stop.is_set():
                st = engine.stats()
                split, dec, pre = st.extra.get("split", {}), st.extra["decode"], st.extra["prefill"]
                trace.append({"t": round(time.monotonic() - t0, 4), "decode_sms": split.get("decode_sms_now"),
                              "requested": split.get("requested"), "decode_step_ms": dec["step_time_us"] / 1e3,
                              "decode_seqs": dec["num_seqs"], "waiting": st.num_waiting,
                              "prefill_queued": pre["num_queued"], "predicted_ttft_s": st.predicted_ttft_s})
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        work = _workload(rate, seconds, seed, max_prompt=min(2048, engine.max_model_len - 330))
        with ThreadPoolExecutor(max_workers=len(work) + 1) as pool:
            results = list(pool.map(lambda a: _one(engine, t0, *a[1], seed=a[0]), enumerate(work)))
        stop.set()
        sampler.join()
        requests_made = engine.stats().extra.get("split", {}).get("num_requests", 0)  # switches completed
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    tpots = [r["tpot_s"] for r in results if r["tpot_s"] is not None]
    met = sum(1 for r in results if r["ttft_s"] is not None and r["ttft_s"] <= 0.5
              and (r["tpot_s"] is None or r["tpot_s"] <= 0.025))

    def pct(xs: list[float], q: float) -> float | None:
        return round(statistics.quantiles(xs, n=100)[q - 1] * 1e3, 1) if len(xs) > 1 else None

    return {"policy": policy, "rate": rate, "seconds": seconds, "num_requests": len(results),
            "ttft_ms_p50": pct(ttfts, 50), "ttft_ms_p90": pct(ttfts, 90), "tpot_ms_p50": pct(tpots, 50),
            "tpot_ms_p90": pct(tpots, 90), "strict_attainment": round(met / max(1, len(results)), 3),
            "num_split_requests": requests_made, "trace": trace, "requests": results}


def plot(runs: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(runs), figsize=(7 * len(runs), 8), sharex=True, squeeze=False)
    for col, run in enumerate(runs):
        tr = run["trace"]
        t = [p["t"] for p in tr]
        axes[0][col].plot(t, [p["decode_sms"] for p in tr], drawstyle="steps-post")
        axes[0][col].set_ylabel("decode SMs (of 132)")
        axes[0][col].set_title(f"split policy {run['policy']}: strict attainment {run['strict_attainment']:.0%}, "
                               f"TTFT p50 {run['ttft_ms_p50']} ms, TPOT p50 {run['tpot_ms_p50']} ms", fontsize=9)
        axes[1][col].plot(t, [p["decode_step_ms"] for p in tr], lw=0.8)
        axes[1][col].axhline(25, color="gray", ls="--", lw=0.8)
        axes[1][col].set_ylabel("last decode step (ms)")
        axes[2][col].plot(t, [p["decode_seqs"] for p in tr], lw=0.8, label="decoding")
        axes[2][col].plot(t, [p["waiting"] for p in tr], lw=0.8, label="without first token")
        axes[2][col].set_ylabel("requests")
        axes[2][col].set_xlabel("time (s)")
        axes[2][col].legend(fontsize=8)
    fig.suptitle(f"{title}, bullet schedule, Poisson {runs[0]['rate']} req/s", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="slo,fixed", help="comma-separated split policies (slo, fixed)")
    ap.add_argument("--rate", type=float, default=12.0, help="requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=40.0, help="how long requests arrive")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=MODEL, help=f"default {MODEL}")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run: no MPS, nominal SMs)")
    args = ap.parse_args()
    mps = None
    if args.device.startswith("cuda"):
        from bullet_ray.gpu.mps import MpsDaemon

        mps = MpsDaemon(f"trace-{os.getpid()}")
        mps.start()
        os.environ.update(mps.env())  # this process never touches CUDA: only the workers are MPS clients
    runs = []
    try:
        for policy in args.policies.split(","):
            run = run_policy(policy, args.rate, args.seconds, args.seed, args.model, args.device)
            print({k: v for k, v in run.items() if k not in ("trace", "requests")}, flush=True)
            runs.append(run)
    finally:
        if mps is not None:
            mps.stop()
    out_dir = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "..", "results")
    name = "gpu_split_trace_h100" if args.device.startswith("cuda") else "cpu_split_trace_smoke"
    save(name, {"model": args.model, "runs": runs})
    device = "H100" if args.device.startswith("cuda") else "CPU (nominal SMs)"
    plot(runs, os.path.join(out_dir, f"{name}.png"), f"{device}, {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
