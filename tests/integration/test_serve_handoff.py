"""`handoff: direct` under Ray Serve: the prefill and decode workers are Ray actors, their hand-off socket lives in
the engine's runtime folder; completions over HTTP equal the in-process engine's (front relay), and aborted
streams give every KV block back."""

from __future__ import annotations

import time

import httpx
import pytest

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

ENGINE = {"model": "dummy:tiny-llama", "num_kv_blocks": 128, "block_size": 4, "max_model_len": 128}
PROMPTS = [[5, 6, 7, 8, 9, 10], [300, 2, 71], list(range(40, 70))]
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def app(serve_url):
    from ray import serve

    from bullet_ray.serve import build_app

    args = {"engine": {**ENGINE, "handoff": "direct"}, "engine_num_cpus": 0, "worker_num_cpus": 0}
    serve.run(build_app(args), name="handoff", route_prefix="/handoff")
    try:
        yield f"{serve_url}/handoff"
    finally:
        serve.delete("handoff")


def test_completions_over_the_direct_hand_off_equal_the_front_relay(app):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    with LLMEngine(EngineConfig(**ENGINE)) as engine:  # handoff: front, in this process
        want = [r.text for r in engine.generate(PROMPTS, params)]
    got = []
    for prompt in PROMPTS:
        body = {"model": "dummy:tiny-llama", "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(f"{app}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        got.append(response.json()["choices"][0]["text"])
    assert got == want
    stats = httpx.get(f"{app}/v1/internal/stats", timeout=30).json()
    assert stats["handoff"]["way"] == "direct" and stats["handoff"]["num_direct"] >= len(PROMPTS)  # none relayed


def test_streams_closed_early_give_every_block_back(app):
    body = {"model": "dummy:tiny-llama", "prompt": PROMPTS[2], "max_tokens": 80, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as client:
        for chunks in (1, 2, 3, 1, 2):
            with client.stream("POST", f"{app}/v1/completions", json=body) as response:
                assert response.status_code == 200
                lines = response.iter_lines()
                seen = 0
                while seen < chunks:
                    if next(lines).startswith("data: "):
                        seen += 1
        deadline = time.monotonic() + 30
        stats: dict = {}
        while time.monotonic() < deadline:
            stats = client.get(f"{app}/v1/internal/stats").json()
            if stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0:
                break
            time.sleep(0.2)
        assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0, stats
