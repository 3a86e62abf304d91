"""How many streamed tokens per second the Serve path carries, with the engine taken out of the picture.

A model-free mock engine (bullet_ray.serve.mock_engine) paces every stream at `--token-delay-ms`; N
concurrent streaming completions over HTTP then ask the path for N x (1000 / delay) tokens/s. Whatever
falls short of that, and the inter-token latency it adds, is the cost of the path: the ingress, the Ray
hops and the HTTP proxy. Both ingress layouts run on one Ray cluster, one after the other:

  separate    BulletIngress -> (Ray streaming call per token) -> BulletEngine     (colocate_ingress: false)
  colocated   one BulletEngine replica runs the routes and the engine front        (colocate_ingress: true)

    python -m benchmarks.path_capacity --out benchmarks/results/path_capacity_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from typing import Any

from benchmarks.faults import free_port


async def _stream(session: Any, url: str, max_tokens: int, gaps: list[float]) -> int:
    body = {"model": "mock", "prompt": "a b c d", "max_tokens": max_tokens, "stream": True}
    last, count = None, 0
    async with session.post(url, json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last, count = now, count + 1
    return count


async def _drive(url: str, streams: int, max_tokens: int) -> dict[str, float]:
    import aiohttp

    gaps: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        counts = await asyncio.gather(*(_stream(session, url, max_tokens, gaps) for _ in range(streams)))
        elapsed = time.perf_counter() - start
    gaps.sort()
    return {"tokens": sum(counts), "tokens_per_s": round(sum(counts) / elapsed, 1),
            "itl_p50_ms": round(gaps[len(gaps) // 2] * 1e3, 2), "itl_p90_ms": round(gaps[int(len(gaps) * 0.9)] * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", default="10,40,80", help="concurrent streams per point (comma-separated)")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per stream")
    parser.add_argument("--token-delay-ms", type=float, default=10.0, help="the mock engine's pace per stream")
    parser.add_argument("--layouts", default="separate,colocated")
    parser.add_argument("--out", default=None, help="JSON result file")
    args = parser.parse_args(argv)

    import ray
    from ray import serve
    from tqdm import tqdm

    from bullet_ray.serve.app import build_app
    from bullet_ray.serve.mock_engine import mock_engine_factory

    port = free_port()
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    points: list[dict[str, Any]] = []
    streams = [int(s) for s in args.streams.split(",")]
    layouts = args.layouts.split(",")
    try:
        with tqdm(total=len(streams) * len(layouts), desc="path capacity") as bar:
            for layout in layouts:
                app_args = {"engine": {"model": "mock"}, "engine_num_cpus": 0, "max_waiting_per_engine": 4096,
                            "colocate_ingress": layout == "colocated"}
                factory = mock_engine_factory(token_delay_s=args.token_delay_ms / 1e3, max_model_len=65536)
                serve.run(build_app(app_args, factory), name=layout, route_prefix=f"/{layout}")
                url = f"http://127.0.0.1:{port}/{layout}/v1/completions"
                for n in streams:
                    point = asyncio.run(_drive(url, n, args.max_tokens))
                    point.update(layout=layout, streams=n,
                                 asked_tokens_per_s=round(n * 1e3 / args.token_delay_ms, 1))
                    points.append(point)
                    bar.update()
                    print(json.dumps(point), flush=True)
                serve.delete(layout)
    finally:
        serve.shutdown()
        ray.shutdown()
    doc = {"benchmark": "path_capacity", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m benchmarks.path_capacity " + " ".join(sys.argv[1:] if argv is None else argv),
           "device": "cpu", "host_cpus": os.cpu_count(), "python": platform.python_version(),
           "load_avg_after": [round(x, 2) for x in os.getloadavg()],
           "token_delay_ms": args.token_delay_ms, "max_tokens": args.max_tokens, "points": points,
           "note": "client, Ray, Serve's proxy and the replicas share this host's CPUs"}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
