"""Overload: send `--factor` (3) times a sustainable rate for `--minutes` (1) with the bench tool, and check the
deployment sheds the excess cleanly.

    python -m benchmarks.overload --url http://127.0.0.1:8000 --sustainable-rate 12 --out benchmarks/results/overload_h100.json
    python -m benchmarks.overload --config deploy/local.yaml --sustainable-rate 1 --minutes 1 --out benchmarks/results/overload_cpu.json

Reports: every status the requests got (the goal: 200 and 429 only, no 5xx, no request without an answer), the
share of 429s, whether 429s carry Retry-After (checked by a probe request every second, since the bench
tool does not keep headers), the admitted requests' SLO attainment (each SLO of --slo over the 200s only;
with --baseline also at the sustainable rate alone, for comparison) and the RSS of every engine process
before, right after, and 10 s after the load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.faults import ServeRun, engine_processes, memory_bytes, model_name, probe, provenance


def _memory(url: str) -> dict[str, Any]:
    pids, _ = engine_processes(url)
    per = {name: memory_bytes(pid) for name, pid in pids.items()}
    return {"processes": per, "rss_total_bytes": sum(m.get("rss", 0) for m in per.values()),
            "rss_anon_total_bytes": sum(m.get("rss_anon", 0) for m in per.values())}


def run_load(url: str, rate: float, duration_s: float, input_tokens: int, output_tokens: int, slos: list[str],
             seed: int) -> dict[str, Any]:
    from benchmarks.serve_bench import BenchConfig, run_benchmark
    from benchmarks.slo import parse_slo
    from benchmarks.traces import WorkloadConfig

    workload = WorkloadConfig(num_prompts=None, duration_s=duration_s, rate_rps=rate, random_input_tokens=input_tokens,
                              random_output_tokens=output_tokens, vocab_low=3, vocab_high=500, seed=seed)
    config = BenchConfig(base_url=url, workload=workload, slos=slos, request_timeout_s=600.0,
                         label=f"{rate:g} req/s")
    result = asyncio.run(run_benchmark(config))
    statuses = Counter(str(r.http_status) if r.http_status is not None else "no_answer" for r in result.records)
    admitted = [r for r in result.records if r.http_status == 200]
    attainment = {}
    for spec in slos:
        slo = parse_slo(spec)
        attainment[slo.name] = sum(slo.meets(r) for r in admitted) / len(admitted) if admitted else None
    num = len(result.records)
    return {"rate_rps": rate, "num_requests": num, "statuses": dict(statuses),
            "share_429": statuses.get("429", 0) / num if num else 0.0,
            "num_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
            "num_without_answer": statuses.get("no_answer", 0) + sum(1 for r in admitted if not r.success),
            "admitted_slo_attainment": attainment, "summary": result.summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running deployment")
    where.add_argument("--config", help="a deploy YAML to `serve run` for this run")
    parser.add_argument("--sustainable-rate", type=float, required=True, help="req/s the deployment sustains")
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--slo", action="append", default=None, help="SLO preset(s) of the bench tool")
    parser.add_argument("--baseline", action="store_true", help="first run the sustainable rate alone")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --config: override an app arg, e.g. --set max_waiting_per_engine=8")
    parser.add_argument("--out", default="benchmarks/results/overload.json")
    args = parser.parse_args(argv)
    slos = args.slo or ["relaxed", "strict"]
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    run = ServeRun(args.config, overrides=overrides) if args.config else None
    if run is not None:
        run.start()
    url = run.url if run is not None else args.url.rstrip("/")
    duration_s = args.minutes * 60
    result: dict[str, Any] = {**provenance(), "url": url, "config": args.config, "overrides": overrides,
                              "factor": args.factor,
                              "sustainable_rate_rps": args.sustainable_rate, "minutes": args.minutes}
    try:
        model = model_name(url)
        if args.baseline:
            result["baseline"] = run_load(url, args.sustainable_rate, duration_s, args.input_tokens,
                                          args.output_tokens, slos, seed=1)
        result["memory_before"] = _memory(url)
        probes: list[tuple[int, str | None]] = []
        stop = threading.Event()

        def probe_loop() -> None:
            while not stop.wait(1.0):
                probes.append(probe(url, model))

        prober = threading.Thread(target=probe_loop, daemon=True)
        prober.start()
        result["overload"] = run_load(url, args.factor * args.sustainable_rate, duration_s, args.input_tokens,
                                      args.output_tokens, slos, seed=2)
        stop.set()
        prober.join()
        result["memory_after"] = _memory(url)
        time.sleep(10)
        result["memory_settled"] = _memory(url)
        refused = [p for p in probes if p[0] == 429]
        result["probes"] = {"statuses": dict(Counter(str(p[0]) for p in probes)),
                            "num_429": len(refused), "num_429_with_retry_after": sum(p[1] is not None for p in refused)}
    finally:
        if run is not None:
            run.stop()
    result["rss_growth_bytes"] = result["memory_settled"]["rss_total_bytes"] - result["memory_before"]["rss_total_bytes"]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    o = result["overload"]
    print(f"{o['num_requests']} requests at {o['rate_rps']:g} req/s: {o['statuses']}, 429 share {o['share_429']:.0%}, "
          f"5xx {o['num_5xx']}, without answer {o['num_without_answer']}, admitted SLO attainment "
          f"{o['admitted_slo_attainment']}, RSS growth {result['rss_growth_bytes'] / 2**20:.0f} MiB")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
