"""The direct prefill -> decode hand-off (`handoff: direct`) on CPU with real worker processes: the same tokens as
transformers (and as the front's relay), every hand-off taken the direct way and timed, aborts and stop strings
that race a hand-off in transit free every block, preempted sequences come back through it."""

from __future__ import annotations

import asyncio
import json
import random

import pytest
import torch

from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from tests.integration.test_async_scheduling import (  # noqa: F401 - fixtures
    NUM_NEW,
    PROMPTS,
    _config,
    _wait_all_free,
    expected,
    hf_folder,
)

pytestmark = pytest.mark.slow


def test_direct_handoff_keeps_the_tokens_and_frees_every_block(hf_folder, expected, tmp_path):  # noqa: F811
    """Asynchronous scheduling (the GPU's default: the host learns a step's tokens one step late); the CPU's default,
    synchronous, is tests/integration/test_serve_handoff.py's."""
    log = tmp_path / "steps.jsonl"
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLMEngine(_config(hf_folder, "bullet", True, handoff="direct", step_log_path=str(log))) as engine:
        results = engine.generate(PROMPTS, greedy)
        assert [r.token_ids for r in results] == expected
        assert engine.num_direct_handoffs == len(PROMPTS)  # none relayed by the front
        assert len(engine.hop_handoff_s) == len(PROMPTS) and all(0 <= h < 10 for h in engine.hop_handoff_s)

        async def concurrently() -> list[list[int]]:
            async def one(prompt: list[int]) -> list[int]:
                ids: list[int] = []
                async for out in engine.stream_async(prompt, greedy):
                    ids += out.token_ids_delta
                return ids
            return list(await asyncio.gather(*(one(p) for p in PROMPTS * 3)))

        assert asyncio.run(concurrently()) == expected * 3  # each request's tokens in order

        # a stop string on the first token: the front finishes the request from the prefill side's message while
        # the sequence is on its way to decode (the abort may overtake it: decode drops it when it arrives)
        first_text = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=1))[0].text
        word = first_text.strip()  # a tokenizer-less model's text: " <id>" per token
        stop = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, stop=[word])
        for out in engine.generate(PROMPTS[:1] * 6, stop):
            assert (out.finish_reason, out.text, out.token_ids) == ("stop", first_text[:first_text.index(word)],
                                                                    expected[0][:1])
        _wait_all_free(engine)

        # aborts at random points, right after the first token (its hand-off in transit) included; then the engine
        # serves as before (a stream submits its request at its first next())
        rng = random.Random(7)
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for _ in range(3):
            streams = [engine.stream(PROMPTS[i % len(PROMPTS)], long) for i in range(8)]
            for s in streams:
                for _ in range(rng.randint(1, 3)):
                    next(s)
                s.close()  # closing a stream aborts its request
        _wait_all_free(engine)
        handoff = engine.stats().extra["handoff"]
        assert (handoff["way"], handoff["num_direct"]) == ("direct", engine.num_direct_handoffs)
        assert 0 <= handoff["hop_p50_ms"] <= handoff["hop_p99_ms"] < 10_000
        assert [r.token_ids for r in engine.generate(PROMPTS, greedy)] == expected
        assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0

    records = [json.loads(line) for line in log.read_text().splitlines()]
    handoffs = [r for r in records if r["kind"] == "handoff"]
    assert handoffs and {r["via"] for r in handoffs} == {"direct"}
    assert all(r["hop_ms"] >= 0 for r in handoffs)


def test_preempted_sequences_come_back_through_the_direct_hand_off(hf_folder, hf_greedy):  # noqa: F811
    from transformers import AutoModelForCausalLM

    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    want = [hf_greedy(model, ids, 20) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 6 requests x 40 tokens need 60 blocks of 4; the pool has 24
    config = _config(hf_folder, "bullet", True, num_kv_blocks=24, kv_watermark=0.0, max_num_batched_tokens=64,
                     handoff="direct")
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        assert engine.num_preemptions > 0  # decode's, relayed back to prefill by the front
        # every prefill ends in a direct hand-off: the first ones and each recompute of a preempted sequence (but
        # one whose recompute samples its last token, which finishes on the prefill side)
        assert len(prompts) < engine.num_direct_handoffs <= len(prompts) + engine.num_preemptions
        _wait_all_free(engine, 24)
    assert [r.token_ids for r in results] == want

