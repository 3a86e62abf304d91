"""The embedded SmolLM2-135M-Instruct through the two-process engine: HF-identical greedy text, shared
weights and KV between the workers, abort, stop strings, seeded sampling, bad input."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidRequest
from tests.split_requests import splits_requested

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain gravity to a child in one sentence.",
    "Translate 'good morning' into Spanish.",
]


@pytest.fixture(scope="module")
def engine():
    with LLMEngine(EngineConfig(schedule="bullet", num_kv_blocks=256, block_size=16)) as eng:
        yield eng


def _chat(engine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=False)


def test_greedy_matches_transformers_on_five_prompts(engine, hf_greedy):
    from transformers import AutoModelForCausalLM

    folder = engine.handles.tokenizer_path
    assert folder and os.path.isdir(folder), "the embedded model is cached as a HF folder"
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts = [_chat(engine, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = engine.generate(prompts, params)
    for ids, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(hf, ids, 32)


def test_capital_of_france(engine):
    params = SamplingParams(temperature=0.0, max_tokens=20)
    [result] = engine.generate([_chat(engine, "What is the capital of France?")], params)
    assert result.text.startswith("The capital of France is Paris.")
    assert result.finish_reason == "stop"  # stopped at <|im_end|>, which is not in the text


def test_workers_share_one_copy_of_weights_and_kv(engine):
    weights_mb = engine.handles.weights.num_bytes / 1e6
    assert weights_mb > 400  # 135M float32 parameters
    assert engine.stats().extra["prefill"]["step"] > 0
    engine.generate([_chat(engine, "Hello!")], SamplingParams(temperature=0.0, max_tokens=8))
    assert engine.stats().extra["decode"]["step"] > 0  # both sides publish to the shared state block
    shared_files = [engine.handles.weights.arena.path, engine.handles.kv_pool.arena.path]
    for role in ("prefill", "decode"):
        proc = psutil.Process(engine.worker_info[role]["pid"])
        mapped = {m.path for m in proc.memory_maps()}
        assert all(f in mapped for f in shared_files), f"{role} does not map the shared arenas"
        uss_mb = proc.memory_full_info().uss / 1e6
        # the weights are loaded straight into the shared file: neither worker holds a private copy
        assert uss_mb < weights_mb, f"{role} USS {uss_mb:.0f} MB >= weights {weights_mb:.0f} MB"


def test_abort_frees_every_block(engine):
    total = engine.stats().num_kv_blocks
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    streams = [engine.stream(_chat(engine, p), params) for p in PROMPTS]
    firsts = [next(s) for s in streams]  # every request is running
    assert all(not f.finished for f in firsts)
    assert engine.stats().num_free_kv_blocks < total
    for s in streams:
        s.close()  # closing a stream aborts its request
    deadline = time.monotonic() + 30
    while engine.stats().num_free_kv_blocks != total and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().num_free_kv_blocks == total
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


def test_stop_string_truncates_and_frees(engine):
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=("Paris",))
    [result] = engine.generate([_chat(engine, "What is the capital of France?")], params)
    assert result.text == "The capital of France is "
    assert result.finish_reason == "stop"
    time.sleep(0.2)
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks


def test_seeded_sampling_repeats_and_differs_across_seeds(engine):
    prompt = _chat(engine, "Tell me a story about a dragon.")
    a, b = engine.generate([prompt, prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=24,
                                                            ignore_eos=True))
    [c] = engine.generate([prompt], SamplingParams(temperature=1.0, seed=8, max_tokens=24, ignore_eos=True))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_bad_requests_raise_typed_errors(engine):
    with pytest.raises(InvalidRequest, match="empty"):
        next(engine.stream([], SamplingParams()))
    with pytest.raises(InvalidRequest, match="vocabulary"):
        next(engine.stream([10**7], SamplingParams()))
    with pytest.raises(InvalidRequest) as err:
        next(engine.stream([1, 2, 3], SamplingParams(max_tokens=engine.max_model_len)))
    assert err.value.code == "context_length_exceeded"
    # no max_tokens in the request: the server's default shrinks to what the context leaves, as in vLLM
    near_full = [1] * (engine.max_model_len - 3)
    default = SamplingParams.from_openai({"temperature": 0, "ignore_eos": True}, default_max_tokens=256)
    [out] = engine.generate([near_full], default)
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_an_aborted_id_is_not_reused_while_a_worker_may_hold_it(engine):
    """A hand-off of the aborted sequence would land in a new request of the same id: its reuse is refused for a
    few seconds (RETIRED_ID_HOLD_S) with an error naming the field; ids never aborted are unaffected."""
    stream = engine.stream([5, 6, 7, 8], SamplingParams(max_tokens=64, ignore_eos=True), request_id="reused")
    next(stream)
    engine.abort("reused")
    assert [o.finish_reason for o in stream][-1] == "abort"
    with pytest.raises(InvalidRequest, match="aborted or stopped") as err:
        next(engine.stream([5, 6], SamplingParams(max_tokens=2), request_id="reused"))
    assert err.value.field == "request_id"
    [out] = list(engine.stream([5, 6], SamplingParams(max_tokens=2), request_id="fresh"))[-1:]
    assert out.finished


def test_split_request_is_followed_by_both_workers(engine):
    start = engine.split_indexes()
    assert start["prefill"] == start["decode"] == start["requested"]
    target = 1 if start["requested"] != 1 else 2
    engine.request_split(target)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.split_indexes() != {"requested": target, "prefill": target,
                                                                      "decode": target}:
        time.sleep(0.05)
    assert engine.split_indexes() == {"requested": target, "prefill": target, "decode": target}
    engine.generate([_chat(engine, "Hi")], SamplingParams(temperature=0.0, max_tokens=4))
    assert engine.stats().extra["decode"]["split_index"] == target
    engine.request_split(start["requested"])


def test_splits_requested_throughout_a_generation_keep_the_tokens(engine):
    """Manual split requests every few milliseconds while both workers run (overlap switch, the default): each
    side follows at its step boundaries with steps in flight, and the greedy tokens are the ones of a run
    without switches; every KV block comes back and the switches are counted."""
    prompts = [_chat(engine, text) for text in ("Name three rivers.", "What is 2 + 2?", "Say hello in French.")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    start = engine.split_indexes()["requested"]
    quiet = [o.token_ids for o in engine.generate(prompts, params)]
    with splits_requested(engine, 0.005, len(engine.ladder_decode_sms)) as seen:
        busy = [o.token_ids for o in engine.generate(prompts, params)]
    assert busy == quiet
    engine.request_split(start)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(engine.split_indexes().values()) != {start}:
        time.sleep(0.05)
    assert set(engine.split_indexes().values()) == {start}
    assert len(seen["prefill"]) > 1 and len(seen["decode"]) > 1  # both sides moved while it generated
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats().num_free_kv_blocks != engine.stats().num_kv_blocks:
        time.sleep(0.05)
    assert engine.stats().num_free_kv_blocks == engine.stats().num_kv_blocks
