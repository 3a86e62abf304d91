"""Serving benchmark: an async OpenAI-API load generator (works against bullet_ray, vLLM and SGLang alike).

Per request it records TTFT, every inter-token gap, TPOT, end-to-end latency and the token counts the
server reports (usage). Prompts are token ids of exactly the requested length, outputs are forced with
`ignore_eos` and `max_tokens`. A sweep of rates gives attainment per rate and the goodput.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --dataset azure-conv \\
        --rates 2,4,8 --num-requests 200 --slo relaxed --out benchmarks/results/bench
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any

import httpx
from tqdm import tqdm

from benchmarks.slo import PRESETS, Slo, attainment, goodput
from benchmarks.traces import Request, build_workload


def prompt_ids(n: int, seed: int, vocab: int = 30000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


async def send(client: httpx.AsyncClient, base_url: str, model: str, req: Request, index: int, seed: int,
               api_key: str | None) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt_ids(req.prompt_tokens, seed + index), "max_tokens": req.output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    record: dict[str, Any] = {"index": index, "arrival_s": req.arrival_s, "prompt_tokens": req.prompt_tokens,
                              "max_tokens": req.output_tokens, "ok": False, "itl_s": []}
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                record["error"] = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                return record
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record["usage"] = chunk["usage"]
                if any(c.get("text") for c in chunk.get("choices", [])):
                    if last is None:
                        record["ttft_s"] = now - start
                    else:
                        record["itl_s"].append(now - last)
                    last = now
        record["e2e_s"] = time.perf_counter() - start
        usage = record.get("usage") or {}
        record["completion_tokens"] = usage.get("completion_tokens", 0)
        record["server_prompt_tokens"] = usage.get("prompt_tokens", 0)
        if record["completion_tokens"] > 1 and "ttft_s" in record:
            record["tpot_s"] = (record["e2e_s"] - record["ttft_s"]) / (record["completion_tokens"] - 1)
        record["ok"] = "ttft_s" in record
    except httpx.HTTPError as e:
        record["error"] = repr(e)
    return record


async def run_workload(base_url: str, model: str, workload: list[Request], seed: int = 0,
                       api_key: str | None = None, max_concurrency: int = 1024, show_progress: bool = True) -> list[dict]:
    """Send every request at its arrival time; return one record per request (in workload order)."""
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    sem = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(workload), desc="requests", disable=not show_progress, file=sys.stderr)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.perf_counter()

        async def one(i: int, req: Request) -> dict:
            await asyncio.sleep(max(0.0, req.arrival_s - (time.perf_counter() - start)))
            async with sem:
                rec = await send(client, base_url, model, req, i, seed, api_key)
            bar.update(1)
            return rec

        records = await asyncio.gather(*(one(i, r) for i, r in enumerate(workload)))
        duration = time.perf_counter() - start
    bar.close()
    for r in records:
        r["run_duration_s"] = duration
    return list(records)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(records: list[dict], slo: Slo) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    duration = max((r["run_duration_s"] for r in records), default=0.0) or 1e-9
    out: dict[str, Any] = {"requests": len(records), "ok": len(ok), "failed": len(records) - len(ok),
                           "request_throughput": len(ok) / duration,
                           "output_token_throughput": sum(r["completion_tokens"] for r in ok) / duration,
                           "slo": slo.name, "attainment": attainment(records, slo)}
    for name, values in (("ttft_s", [r["ttft_s"] for r in ok]), ("tpot_s", [r["tpot_s"] for r in ok if "tpot_s" in r]),
                         ("itl_s", [g for r in ok for g in r["itl_s"]]), ("e2e_s", [r["e2e_s"] for r in ok])):
        out[name] = {"mean": statistics.fmean(values) if values else None, "p50": _pct(values, 50),
                     "p90": _pct(values, 90), "p99": _pct(values, 99)}
    return out


def plot(results: dict[str, dict[float, dict]], path: str) -> None:
    """Attainment, throughput and TTFT p90 vs rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for system, by_rate in results.items():
        rates = sorted(by_rate)
        axes[0].plot(rates, [by_rate[r]["attainment"] for r in rates], marker="o", label=system)
        axes[1].plot(rates, [by_rate[r]["request_throughput"] for r in rates], marker="o", label=system)
        axes[2].plot(rates, [by_rate[r]["ttft_s"]["p90"] or 0 for r in rates], marker="o", label=system)
    axes[0].axhline(0.9, color="grey", linestyle="--", linewidth=1)
    for ax, title in zip(axes, ("SLO attainment", "served requests/s", "TTFT p90 (s)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def environment(base_url: str, model: str) -> dict[str, Any]:
    return {"host": platform.node(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "server": base_url, "model": model, "command": "python -m benchmarks.serve_bench " + " ".join(sys.argv[1:])}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (…/v1 is appended)")
    p.add_argument("--model", default=None, help="model name; default: the first of /v1/models")
    p.add_argument("--api-key", default=None, help="Bearer token, if the server wants one")
    p.add_argument("--dataset", default="azure-conv", choices=["azure-conv", "azure-code", "random"],
                   help="request lengths: the Azure 2023 traces or random")
    p.add_argument("--trace-dir", default=None, help="folder of code.csv / conv.csv (default ../shared/data/...)")
    p.add_argument("--rates", default="1", help="comma-separated Poisson rates (req/s) to sweep")
    p.add_argument("--trace-scale", type=float, default=None, help="replay trace timestamps sped up by this factor")
    p.add_argument("--num-requests", type=int, default=100, help="requests per rate")
    p.add_argument("--max-prompt-tokens", type=int, default=4096, help="clip prompt lengths")
    p.add_argument("--max-output-tokens", type=int, default=1024, help="clip output lengths")
    p.add_argument("--slo", default="relaxed", choices=sorted(PRESETS), help="SLO preset for attainment")
    p.add_argument("--seed", type=int, default=0, help="same seed: same arrivals, lengths and prompts")
    p.add_argument("--max-concurrency", type=int, default=1024, help="requests in flight at most")
    p.add_argument("--out", default="benchmarks/results/serve_bench", help="output prefix (.json, .png)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    model = args.model or httpx.get(f"{args.base_url}/v1/models", timeout=30,
                                    headers={"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
                                    ).json()["data"][0]["id"]
    slo = Slo.preset(args.slo)
    rates = [float(x) for x in args.rates.split(",")]
    per_rate, records = {}, {}
    for rate in rates:
        workload = build_workload(args.dataset, args.num_requests, args.seed, rate=rate, trace_scale=args.trace_scale,
                                  max_prompt_tokens=args.max_prompt_tokens, max_output_tokens=args.max_output_tokens,
                                  trace_dir=args.trace_dir)
        recs = asyncio.run(run_workload(args.base_url, model, workload, args.seed, args.api_key, args.max_concurrency))
        per_rate[rate], records[rate] = summarize(recs, slo), recs
        s = per_rate[rate]
        print(f"rate {rate:g}: ok {s['ok']}/{s['requests']}, attainment {s['attainment']:.2%}, "
              f"TTFT p90 {s['ttft_s']['p90']}, TPOT p90 {s['tpot_s']['p90']}, {s['request_throughput']:.2f} req/s")
    result = {"environment": environment(args.base_url, model), "config": vars(args), "summary": per_rate,
              "goodput_req_s": goodput({r: s["attainment"] for r, s in per_rate.items()}), "records": records}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot({model: per_rate}, args.out + ".png")
    print(f"goodput ({slo.name}): {result['goodput_req_s']} req/s; saved {args.out}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
