"""The prefill -> decode hand-off both ways on one machine: relayed by the engine front (`handoff: front`) against
sent by the prefill worker itself (`handoff: direct`), the bullet schedule, same engine settings and requests.

Each way serves the same requests in rounds that alternate front / direct (drift on a shared host falls on both);
a round sends `--num-requests` streams from this process's event loop at a Poisson `--rate` (the front's receive
thread shares the GIL with them, as it does with a Serve replica's event loop). Per way:
  hop        the prefill worker's send -> the decode worker taking the hand-off (the workers' clock; it includes
             waiting for the decode side's step in flight, which both ways share)
  gap12      the client's gap between a request's first and second token: the hand-off sits in it (0 where one
             wake-up of the client's loop brought both)
  ttft, itl  the client's time to the first token and between later tokens

    python -m benchmarks.handoff_ab                              # CPU, dummy tiny-llama, ~1 minute
    python -m benchmarks.handoff_ab --device cuda --model dummy:llama-3.1-8b --rate 16 --out $OUT/handoff_ab.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.hops import emit, percentiles

WAYS = ("front", "direct")


def _prompts(n: int, vocab: int, rng: random.Random, lengths: tuple[int, int]) -> list[list[int]]:
    return [[rng.randrange(5, vocab - 5) for _ in range(rng.randint(*lengths))] for _ in range(n)]


async def _round(engine: Any, prompts: list[list[int]], params: Any, rate: float, seed: int) -> list[list[float]]:
    """Every prompt streamed at Poisson arrivals; each request's token arrival times (its start first)."""
    rng = random.Random(seed)

    async def one(prompt: list[int], delay: float) -> list[float]:
        await asyncio.sleep(delay)
        stamps = [time.perf_counter()]
        async for out in engine.stream_async(prompt, params):
            stamps.extend([time.perf_counter()] * len(out.token_ids_delta))
        return stamps

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    return list(await asyncio.gather(*(one(p, d) for p, d in zip(prompts, delays))))


def run_way(args: argparse.Namespace, way: str, round_index: int) -> dict[str, Any]:
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    config = EngineConfig(model=args.model, device=args.device, schedule="bullet", handoff=way,
                          num_kv_blocks=1024 if args.device == "cpu" else None, max_num_seqs=args.max_num_seqs,
                          kv_cache_memory_gb=0.25 if args.device == "cpu" else 16.0)
    params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
    with LLMEngine(config) as engine:
        # the same prompts for both ways (the seed), others each round
        prompts = _prompts(args.num_requests, engine.vocab_size, random.Random(args.seed + round_index),
                           args.lengths)
        engine.generate(prompts[:2], params)  # warm-up
        engine.hop_handoff_s.clear()
        warm_direct = engine.num_direct_handoffs
        runs = asyncio.run(_round(engine, prompts, params, args.rate, seed=round_index))
        hops = list(engine.hop_handoff_s)
        direct = engine.num_direct_handoffs - warm_direct
    return {"hop_s": hops, "stamps": runs, "num_direct_handoffs": direct}


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    hops = [h for s in samples for h in s["hop_s"]]
    stamps = [r for s in samples for r in s["stamps"] if len(r) >= 3]
    return {"hop": percentiles(hops),
            "gap12": percentiles([r[2] - r[1] for r in stamps]),
            "ttft": percentiles([r[1] - r[0] for r in stamps]),
            "itl": percentiles([b - a for r in stamps for a, b in zip(r[2:], r[3:])]),
            "num_requests": len(stamps), "num_direct_handoffs": sum(s["num_direct_handoffs"] for s in samples)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=40, help="requests per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per way, alternating front / direct")
    parser.add_argument("--rate", type=float, default=8.0, help="Poisson arrivals per second within a round")
    parser.add_argument("--num-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--prompt-tokens", default="16,128", help="prompt lengths drawn uniformly in MIN,MAX")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.prompt_tokens.split(","))
        if not 1 <= lo <= hi:
            raise ValueError
    except ValueError:
        parser.error(f"--prompt-tokens: expected MIN,MAX with 1 <= MIN <= MAX, got {args.prompt_tokens!r}")
    args.lengths = (lo, hi)
    samples: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    from tqdm import tqdm

    with tqdm(total=args.rounds * len(WAYS), desc="handoff rounds") as bar:
        for r in range(args.rounds):
            for way in WAYS if r % 2 == 0 else WAYS[::-1]:
                samples[way].append(run_way(args, way, r))
                bar.update(1)
    result = {w: summarize(s) for w, s in samples.items()}
    payload = {"benchmark": "handoff_ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "python -m benchmarks.handoff_ab " + shlex.join(sys.argv[1:] if argv is None else argv),
               "model": args.model, "device": args.device, "rate": args.rate, "rounds": args.rounds,
               "num_requests": args.num_requests, "num_tokens": args.num_tokens, "prompt_tokens": [lo, hi],
               "host_load_avg": [round(x, 2) for x in os.getloadavg()], "host_cpus": os.cpu_count(), **result,
               "direct_minus_front_p50_ms": {k: round(result["direct"][k]["p50_ms"] - result["front"][k]["p50_ms"], 3)
                                             for k in ("hop", "gap12", "ttft", "itl")}}
    emit(payload, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
