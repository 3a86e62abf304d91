"""`colocate_ingress: true`: the OpenAI routes and the engine in one Serve deployment (BulletEngine), on the
session's Ray cluster with a mock engine. Same answers, errors, refusals and clean-up as the two-deployment app."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

PREFIX = "/colo"
HEADERS = {"Authorization": "Bearer k1"}


@pytest.fixture(scope="module")
def colo(serve_url):
    from ray import serve

    from bullet_ray.serve.app import build_app
    from bullet_ray.serve.mock_engine import mock_engine_factory

    args = {"engine": {"model": "mock"}, "colocate_ingress": True, "max_waiting_per_engine": 2,
            "api_keys": ["k1"], "engine_num_cpus": 0, "max_request_bytes": 4096}
    serve.run(build_app(args, mock_engine_factory(token_delay_s=0.01, first_token_delay_s=0.3)), name="colo",
              route_prefix=PREFIX)
    yield f"{serve_url}{PREFIX}"
    serve.delete("colo")


def test_one_deployment_serves_both_roles(colo):
    from ray import serve

    assert set(serve.status().applications["colo"].deployments) == {"BulletEngine"}


def test_streamed_and_whole_completions_carry_the_engine_tokens(colo):
    body = {"model": "mock", "prompt": "a b c", "max_tokens": 4}
    r = httpx.post(f"{colo}/v1/completions", json=body, headers=HEADERS, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " t3 t4 t5 t6"
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    pieces = []
    with httpx.stream("POST", f"{colo}/v1/completions", json={**body, "stream": True, "n": 2}, headers=HEADERS,
                      timeout=30) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    pieces.append((choice["index"], choice["text"]))
            elif line == "data: [DONE]":
                break
    for index in (0, 1):
        assert "".join(t for i, t in pieces if i == index) == " t3 t4 t5 t6"


def test_usage_counts_each_prompt_once_and_a_repeated_prompt_twice(colo):
    """n choices of one prompt share its count (as OpenAI counts); the same prompt sent twice counts twice."""
    for prompt, n, prompt_tokens in ((["a b c", "a b c"], 1, 6), ("a b c", 2, 3)):  # two engine requests each
        body = {"model": "mock", "prompt": prompt, "max_tokens": 4, "n": n}
        r = httpx.post(f"{colo}/v1/completions", json=body, headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2
        assert r.json()["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 8,
                                     "total_tokens": prompt_tokens + 8}


def test_a_body_over_max_request_bytes_is_a_413_even_without_a_length(colo):
    """Through Serve: a chunked body (no Content-Length) is cut off once past max_request_bytes."""
    big = json.dumps({"model": "mock", "prompt": "a " * 4000, "max_tokens": 2}).encode()
    chunks = iter([big[i:i + 1024] for i in range(0, len(big), 1024)])
    r = httpx.post(f"{colo}/v1/completions", content=chunks, headers={**HEADERS, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == 413 and "4096" in r.json()["error"]["message"]
    r = httpx.post(f"{colo}/v1/completions", content=big, headers={**HEADERS, "content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 413 and f"{len(big)} bytes" in r.json()["error"]["message"]


def test_api_key_and_bad_input_get_openai_errors(colo):
    r = httpx.post(f"{colo}/v1/completions", json={"model": "mock", "prompt": "a", "max_tokens": 2}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{colo}/v1/completions", json={"model": "mock", "prompt": "a", "max_tokens": -1},
                   headers=HEADERS, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert httpx.get(f"{colo}/health", timeout=30).json() == {"status": "ok"}


def test_disconnect_mid_stream_frees_every_kv_block(colo):
    body = {"model": "mock", "prompt": "a b c d", "max_tokens": 300, "stream": True}
    with httpx.stream("POST", f"{colo}/v1/completions", json=body, headers=HEADERS, timeout=60) as r:
        lines = r.iter_lines()
        assert any(next(lines).startswith("data: ") for _ in range(4))
        stats = httpx.get(f"{colo}/v1/internal/stats", headers=HEADERS).json()
        assert stats["num_free_kv_blocks"] < stats["num_kv_blocks"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(f"{colo}/v1/internal/stats", headers=HEADERS).json()
        if stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0


def test_overload_answers_429_with_retry_after_and_loses_nothing(colo):
    body = {"model": "mock", "prompt": "a b c", "max_tokens": 3}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{colo}/v1/completions", json=body, headers=HEADERS)
                                          for _ in range(12)))

    codes = [r.status_code for r in asyncio.run(fire())]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2


def test_a_handle_reaches_the_engine_stream(colo):
    """benchmarks/hops.py and the controller call the BulletEngine deployment by handle."""
    from ray import serve

    from bullet_ray.engine.sampling_params import SamplingParams

    handle = serve.get_deployment_handle("BulletEngine", app_name="colo")

    async def collect() -> str:
        text = ""
        gen = handle.options(stream=True).generate.remote(
            {"prompt": "a b", "params": SamplingParams(max_tokens=3), "request_id": "h1"})
        async for out in gen:
            text += out.text_delta
        return text

    assert asyncio.run(collect()) == " t2 t3 t4"
    assert handle.stats.remote().result(timeout_s=30)["num_running"] == 0
