"""Overload on a real local Ray Serve: one engine replica (tiny dummy model, decode batches of 2, at most 4
waiting requests, Serve's cap of 4 ongoing + 4 queued requests) gets about 3x the request rate it sustains. Beyond capacity it answers 429 with
Retry-After; nothing gets a 5xx, every request gets an answer, and the replica's memory does not grow with
the refused load."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP, PREFIX = "overload", "/overload"
MODEL = "dummy:tiny-llama"
MAX_TOKENS = 48


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def _request(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, str | None]:
    r = await client.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": [5 + i % 50, 6, 7, 8] * 4,
                                                          "max_tokens": MAX_TOKENS, "ignore_eos": True})
    if r.status_code not in (200, 429):
        return r.status_code, r.text[:300]
    return r.status_code, r.headers.get("retry-after")


async def _capacity_rps(url: str, concurrency: int, duration_s: float) -> float:
    """Completed requests per second with `concurrency` clients sending back to back."""
    done = 0
    deadline = time.monotonic() + duration_s

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            status, _ = await _request(client, url, k)
            assert status == 200
            done += 1

    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(client_loop(client, k) for k in range(concurrency)))
    return done / (time.monotonic() - start)


async def _open_loop(url: str, rate_rps: float, duration_s: float) -> list[tuple[int, str | None] | BaseException]:
    rng = random.Random(0)
    tasks = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < duration_s:
            tasks.append(asyncio.create_task(_request(client, url, i)))
            i += 1
            await asyncio.sleep(rng.expovariate(rate_rps))
        return await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def app(chaos_serve_url, tmp_path_factory):
    from ray import serve

    from bullet_ray.serve import build_app

    args = {"engine": {"model": MODEL, "num_kv_blocks": 256, "max_num_seqs": 2,
                       "runtime_dir": str(tmp_path_factory.mktemp("overload_runtime"))},
            "num_engines": 1, "engine_num_cpus": 0, "worker_num_cpus": 0, "max_waiting_per_engine": 4,
            "max_ongoing_requests": 4, "retry_after_s": 2}
    serve.run(build_app(args), name=APP, route_prefix=PREFIX)
    yield chaos_serve_url + PREFIX
    serve.delete(APP)


def test_three_times_the_sustainable_rate_gets_429s_and_nothing_is_lost(app):
    url = app
    capacity = asyncio.run(_capacity_rps(url, concurrency=2, duration_s=6))  # warms up too
    pid = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()["pid"]
    rss_before = _rss_bytes(pid)
    results = asyncio.run(_open_loop(url, 3 * capacity, duration_s=10))
    rss_after = _rss_bytes(pid)

    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]  # every request got an answer
    statuses = [r[0] for r in results if not isinstance(r, BaseException)]
    assert set(statuses) <= {200, 429}, [r for r in results if r[0] not in (200, 429)][:3]
    assert statuses.count(429) > 0 and statuses.count(200) > 0, (capacity, statuses)
    assert all(r[1] == "2" for r in results if not isinstance(r, BaseException) and r[0] == 429)
    stats = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]  # nothing held after the load
    assert rss_after - rss_before < 100 * 2**20, (rss_before, rss_after)
