"""Asynchronous scheduling on CPU: the host learns each step's tokens one step late, and nothing changes.

Every schedule (bullet, static, chunked) with `async_scheduling` on and off: greedy output equals
transformers token for token (preemption included), max_tokens and stop strings end exactly where they
should, an abort mid-stream frees every block, and the offline `generate` returns the streaming path's
tokens in order. Engines start real worker processes, so the engines are shared per module where the
tests allow it.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [300, 2, 71], list(range(40, 77)), [9] * 5 + [13, 14]]
NUM_NEW = 20
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    import json
    from importlib.resources import files

    from transformers import AutoConfig, AutoModelForCausalLM

    folder = str(tmp_path_factory.mktemp("hf") / "tiny-llama")
    cfg = json.loads((files("bullet_ray.models") / "presets" / "tiny-llama.json").read_text())
    torch.manual_seed(1234)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def expected(hf_folder, hf_greedy) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    return [hf_greedy(model, ids, NUM_NEW) for ids in PROMPTS]


def _config(folder: str, schedule: str, is_async: bool, **kw) -> EngineConfig:
    # a small token budget forces chunked prompts and mixed batches
    base = dict(model=folder, schedule=schedule, num_kv_blocks=NUM_BLOCKS, block_size=4,
                max_num_batched_tokens=16, async_scheduling=is_async)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("is_async", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("schedule", ["bullet", "static", "chunked"])
def test_greedy_matches_transformers(schedule, is_async, hf_folder, expected):
    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLMEngine(_config(hf_folder, schedule, is_async)) as engine:
        results = engine.generate(PROMPTS, greedy)
        assert [r.token_ids for r in results] == expected
        # max_tokens exact, for several limits in one batch (the host knows lengths before it knows ids)
        limits = [1, 2, 5, 13]
        capped = engine.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                                           for n in limits])
        assert [r.token_ids for r in capped] == [e[:n] for e, n in zip(expected, limits)]
        assert [r.finish_reason for r in capped] == ["length"] * 4
        # a stop token ends the request at its first occurrence (included in the ids, as vLLM does)
        stop_at = expected[0][6]
        first = expected[0].index(stop_at)
        stopped = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                              stop_token_ids=[stop_at]))
        assert stopped[0].token_ids == expected[0][:first + 1]
        assert stopped[0].finish_reason == "stop"
        _wait_all_free(engine)


@pytest.mark.parametrize("schedule", ["bullet", "chunked"])
def test_preemption_matches_transformers_async(schedule, hf_folder, hf_greedy):
    from transformers import AutoModelForCausalLM

    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    model = AutoModelForCausalLM.from_pretrained(hf_folder, dtype=torch.float32).eval()
    want = [hf_greedy(model, ids, 20) for ids in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 6 requests x 40 tokens need 60 blocks of 4; the pool has 24
    config = _config(hf_folder, schedule, True, num_kv_blocks=24, kv_watermark=0.0, max_num_batched_tokens=64)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        if schedule == "bullet":  # the chunked worker recomputes in place; the front never sees it
            assert engine.stats().num_preemptions > 0
        _wait_all_free(engine, 24)
    assert [r.token_ids for r in results] == want


@pytest.mark.parametrize("schedule", ["bullet", "chunked"])
def test_stop_string_abort_and_streaming_async(schedule, hf_folder, expected):
    """Stop strings (checked in the front on text) truncate exactly; an abort mid-stream frees its blocks;
    `generate` returns in order what `stream` yields."""
    with LLMEngine(_config(hf_folder, schedule, True)) as engine:
        # dummy-tokenizer-less folders stream ' <id>' per token: a stop string on a token's text
        greedy = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        streamed = []
        for prompt in PROMPTS:
            ids: list[int] = []
            for out in engine.stream(prompt, greedy):
                ids += out.token_ids_delta
            streamed.append(ids)
        offline = engine.generate(PROMPTS, greedy, use_tqdm=True)
        assert [r.token_ids for r in offline] == streamed == expected
        assert engine.stats().extra["num_graph_captures_serving"] == 0

        async def concurrently() -> list[list[int]]:  # asyncio consumers get a step's outputs in one wake-up
            async def one(prompt: list[int]) -> list[int]:
                ids: list[int] = []
                async for out in engine.stream_async(prompt, greedy):
                    ids += out.token_ids_delta
                return ids
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))

        assert asyncio.run(concurrently()) == expected

        text = engine.generate([PROMPTS[0]], greedy)[0].text
        stop = text.split()[5]  # the 6th token's text
        cut = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=NUM_NEW,
                                                          ignore_eos=True, stop=[stop]))[0]
        assert cut.finish_reason == "stop"
        assert cut.text == text[:text.index(stop)]

        # abort after the first streamed token; the other request runs on and all blocks come back
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        gen = engine.stream(PROMPTS[2], long)
        first = next(gen)
        assert first.token_ids_delta
        gen.close()  # closing the stream aborts the request
        rest = engine.generate([PROMPTS[1]], greedy)
        assert rest[0].token_ids == expected[1]
        _wait_all_free(engine)


def _wait_all_free(engine: LLMEngine, num_blocks: int = NUM_BLOCKS) -> None:
    import time

    deadline = time.monotonic() + 10
    while engine.stats().num_free_kv_blocks != num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().num_free_kv_blocks == num_blocks
