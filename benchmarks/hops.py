"""Where a token's time goes between the worker and the client: latency added by each hop, at light load.

The same requests (one at a time, streamed, greedy, ignore_eos) are timed at four points of the path:
  worker -> front      StepOutputs carry the worker's send time; the front records the hop (same host clock)
  in-process engine    `LLMEngine.stream` consumed in this process (worker -> front -> consumer)
  Serve handle         `BulletEngine.generate` through a DeploymentHandle (adds the replica hop: front ->
                       Serve replica -> Ray object transfer -> caller)
  HTTP                 POST /v1/completions with stream=true (adds the ingress routes, proxy and SSE framing;
                       with --layout separate also the Ray hop from the engine replica to the ingress)
With --direct-ingress (Ray Serve's RAY_SERVE_ENABLE_DIRECT_INGRESS, experimental) the replica serves HTTP on
its own port and the HTTP level goes there instead of through the Serve proxy (the handle level is unchanged,
so `ingress_http_hop_ttft_p50` may come out negative).
Each level reports TTFT and inter-token latency (p50, p90); the differences between levels are the hops'
costs: `serve_overhead_ttft_ms` (HTTP - in-process) is what the issue's target (< 5 ms) and
`per_token_overhead_ms` (HTTP ITL - in-process ITL, < 0.3 ms) are about.

    python -m benchmarks.hops                                     # CPU, dummy tiny-llama, ~1 minute
    python -m benchmarks.hops --device cuda --model dummy:llama-3.1-8b --out $OUT/hops.json   # GPU
    python -m benchmarks.hops --direct-ingress                    # HTTP straight to the replica, no proxy
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PROMPT_LEN = 64


def percentiles(values: list[float]) -> dict[str, float]:
    """p50 and p90 (ms) of durations in seconds, and their count."""
    if not values:
        return {"p50_ms": float("nan"), "p90_ms": float("nan"), "n": 0}
    ordered = sorted(values)
    return {"p50_ms": round(1e3 * statistics.median(ordered), 3),
            "p90_ms": round(1e3 * ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3), "n": len(ordered)}


def _timings(stamps: list[list[float]], starts: list[float]) -> dict[str, Any]:
    """TTFT and inter-token gaps from each request's token arrival times."""
    ttft = [s[0] - t0 for s, t0 in zip(stamps, starts) if s]
    itl = [b - a for s in stamps for a, b in zip(s, s[1:])]
    return {"ttft": percentiles(ttft), "itl": percentiles(itl)}


def _prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(17 * i + 31 * j) % (vocab - 10) + 5 for j in range(PROMPT_LEN)] for i in range(n)]


def in_process(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
    with LLMEngine(args.engine_config) as engine:
        prompts = _prompts(args.num_requests + 2, engine.vocab_size)
        engine.generate(prompts[:2], params)  # warm-up
        engine.hop_worker_to_front_s.clear()
        stamps, starts = [], []
        for prompt in prompts[2:]:
            starts.append(time.perf_counter())
            got: list[float] = []
            for out in engine.stream(prompt, params):
                if out.token_ids_delta:
                    got.extend([time.perf_counter()] * len(out.token_ids_delta))
            stamps.append(got)
        result = _timings(stamps, starts)
        result["worker_to_front"] = percentiles(list(engine.hop_worker_to_front_s))
        return result, engine.vocab_size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _through_handle(handle: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    stamps, starts = [], []
    for i, prompt in enumerate(prompts):
        starts.append(time.perf_counter())
        got: list[float] = []
        gen = handle.options(stream=True).generate.remote({"prompt": prompt, "params": params,
                                                            "request_id": f"hops-handle-{i}"})
        async for out in gen:
            if getattr(out, "token_ids_delta", None):
                got.extend([time.perf_counter()] * len(out.token_ids_delta))
        stamps.append(got)
    return _timings(stamps, starts)


async def _through_http(url: str, model: str, prompts: list[list[int]], num_tokens: int) -> dict[str, Any]:
    import httpx

    stamps, starts = [], []
    async with httpx.AsyncClient(timeout=120) as client:
        for prompt in prompts:
            body = {"model": model, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0.0,
                    "ignore_eos": True, "stream": True}
            starts.append(time.perf_counter())
            got: list[float] = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunk = json.loads(line[6:])
                        text = chunk["choices"][0].get("text") if chunk.get("choices") else ""
                        if text:  # a dummy model's text is ' <id>' per token; a chunk may carry several
                            got.extend([time.perf_counter()] * max(1, text.count(" <")))
            stamps.append(got)
    return _timings(stamps, starts)


def _replica_url(app_name: str) -> str:
    """The HTTP address of the application's (first) ingress replica under direct ingress (benchmarks.direct_ingress:
    the Serve controller's target groups, a private Ray API); serve.run has returned, so a replica is running."""
    from benchmarks.direct_ingress import replica_url

    url = replica_url(app_name)
    if url is None:
        raise RuntimeError(f"no replica serving HTTP for application {app_name!r}: is direct ingress on?")
    return url


def through_serve(args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    import ray
    from ray import serve

    from benchmarks.direct_ingress import ENV_VAR as DIRECT_INGRESS_ENV_VAR
    from bullet_ray.engine.sampling_params import SamplingParams
    from bullet_ray.serve import build_app

    port = _free_port()
    if args.direct_ingress:  # read by the Serve controller and replicas this ray.init starts
        os.environ[DIRECT_INGRESS_ENV_VAR] = "1"
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        engine = {k: getattr(args.engine_config, k) for k in ("model", "device", "schedule", "num_kv_blocks",
                                                              "kv_cache_memory_gb", "max_num_seqs", "async_scheduling")}
        app_args = {"engine": engine, "num_engines": 1, "worker_num_cpus": 0, "engine_num_cpus": 0,
                    "colocate_ingress": args.layout == "colocated"}
        serve.run(build_app(app_args), name="hops", route_prefix="/")
        handle = serve.get_deployment_handle("BulletEngine", app_name="hops")
        params = SamplingParams(temperature=0.0, max_tokens=args.num_tokens, ignore_eos=True)
        prompts = _prompts(args.num_requests + 2, vocab)
        url = _replica_url("hops") if args.direct_ingress else f"http://127.0.0.1:{port}"

        async def both() -> tuple[dict[str, Any], dict[str, Any]]:
            await _through_handle(handle, prompts[:2], params)  # warm-up
            await _through_http(url, args.engine_config.model, prompts[:2], args.num_tokens)
            return (await _through_handle(handle, prompts[2:], params),
                    await _through_http(url, args.engine_config.model, prompts[2:], args.num_tokens))

        by_handle, by_http = asyncio.run(both())
        return {"serve_handle": by_handle, "http": by_http}
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    from bullet_ray.config import EngineConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:tiny-llama")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--schedule", default="chunked", choices=["chunked", "bullet", "static"])
    parser.add_argument("--num-requests", type=int, default=10)
    parser.add_argument("--num-tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--no-serve", action="store_true", help="in-process levels only (no Ray)")
    parser.add_argument("--layout", default="colocated", choices=["colocated", "separate"],
                        help="colocated: the routes in the engine replica (deploy/*.yaml); separate: an ingress "
                             "deployment calling the engine deployment per streamed token")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="start Serve with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 (experimental in Ray): the replica "
                             "serves HTTP on its own port and the HTTP level goes there, bypassing the Serve proxy")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    args.engine_config = EngineConfig(model=args.model, device=args.device, schedule=args.schedule,
                                      num_kv_blocks=1024 if args.device == "cpu" else None, max_num_seqs=32,
                                      kv_cache_memory_gb=4.0 if args.device != "cpu" else 0.25)
    result: dict[str, Any] = {}
    result["in_process"], vocab = in_process(args)
    if not args.no_serve:
        result.update(through_serve(args, vocab))
        base, http, handle = result["in_process"], result["http"], result["serve_handle"]
        result["hops_ms"] = {
            "worker_to_front_p50": base["worker_to_front"]["p50_ms"],
            "replica_hop_ttft_p50": round(handle["ttft"]["p50_ms"] - base["ttft"]["p50_ms"], 3),
            "ingress_http_hop_ttft_p50": round(http["ttft"]["p50_ms"] - handle["ttft"]["p50_ms"], 3),
            "serve_overhead_ttft_p50": round(http["ttft"]["p50_ms"] - base["ttft"]["p50_ms"], 3),
            "per_token_overhead_p50": round(http["itl"]["p50_ms"] - base["itl"]["p50_ms"], 3),
        }
    payload = {"benchmark": "hops", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "python -m benchmarks.hops " + " ".join(sys.argv[1:] if argv is None else argv),
               "model": args.model, "device": args.device, "schedule": args.schedule, "layout": args.layout,
               "direct_ingress": args.direct_ingress,
               "num_requests": args.num_requests, "num_tokens": args.num_tokens, "prompt_tokens": PROMPT_LEN,
               # other processes on the host skew every figure: the 1/5/15-minute load averages, and the cores
               "host_load_avg": [round(x, 2) for x in os.getloadavg()], "host_cpus": os.cpu_count(), **result}
    emit(payload, args.out)
    return 0


def emit(payload: dict[str, Any], out: Path | None) -> None:
    """Print a benchmark's JSON and write it to `out` (its folder made), if given."""
    print(json.dumps(payload, indent=1))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    sys.exit(main())
