"""Layer-wise prefill end to end on CPU: a 4-layer tiny Llama whose prefill batches run in 2 or 3 layer
groups (chunked prompts included, with the model-driven split policy deciding between groups, and with
asynchronous scheduling, which collects the step before a layer-wise one) gives exactly the greedy tokens of the whole prefill and of transformers;
so do decode steps in pieces (`decode_pieces`: the split followed between them, the step before collected at the
first boundary)."""

from __future__ import annotations

import json
import os
from collections import Counter
from importlib.resources import files

import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from tests.split_requests import splits_requested

pytestmark = pytest.mark.slow

# the third prompt (37 tokens) is chunked by the 16-token budget; the second (3 tokens) runs whole
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [300, 2, 71], list(range(40, 77)), [9] * 5 + [13, 14]]
NUM_NEW = 16
MIN_TOKENS = 4


@pytest.fixture(scope="module")
def folder_and_expected(tmp_path_factory, hf_greedy):
    """A 4-layer tiny Llama saved by transformers with random weights, and its greedy continuations."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((files("bullet_ray.models") / "presets" / "tiny-llama.json").read_text())
    cfg["num_hidden_layers"] = 4
    folder = os.path.join(str(tmp_path_factory.mktemp("hf_layerwise")), "tiny-llama-4l")
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return folder, [hf_greedy(model, ids, NUM_NEW) for ids in PROMPTS]


@pytest.mark.parametrize("num_groups,split_policy,is_async,decode_pieces",
                         [(1, "fixed", False, 1), (2, "fixed", False, 1), (3, "slo", False, 1), (2, "slo", True, 1),
                          (1, "slo", True, 2), (2, "slo", False, 4), (1, "fixed", True, 3)])
def test_layerwise_prefill_keeps_the_tokens(folder_and_expected, num_groups, split_policy, is_async, decode_pieces,
                                            tmp_path):
    folder, expected = folder_and_expected
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=folder, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                          prefill_layer_groups=num_groups, prefill_layer_group_min_tokens=MIN_TOKENS,
                          split_policy=split_policy, async_scheduling=is_async, step_log_path=str(log),
                          decode_pieces=decode_pieces)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLMEngine(config) as engine:
        results = engine.generate(PROMPTS, params)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.num_free_kv_blocks == 64
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "step"]
    prefill = [r for r in steps if r["side"] == "prefill"]
    assert sum(r["num_tokens"] for r in prefill) == sum(len(p) for p in PROMPTS)
    # every long prefill ran in groups, a short one whole
    for r in prefill:
        assert r["layer_groups"] == (num_groups if r["num_tokens"] >= MIN_TOKENS else 1)
    # decode steps run in pieces only where the split moves (slo); every decoded token came from one
    decode = [r for r in steps if r["side"] == "decode"]
    assert all(r["layer_groups"] == (decode_pieces if split_policy == "slo" else 1) for r in decode)
    assert sum(r["num_tokens"] for r in decode) == len(PROMPTS) * (NUM_NEW - 1)
    if split_policy == "slo" and decode_pieces >= 4:
        # a step in pieces runs while it launches: timed from its launch's start (or the step before's collect, on
        # CPU after its first piece), not from the launch's end, where nothing of it would be left to time
        assert all(r["measured_ms"] >= 0.5 * r["forward_ms"] for r in decode)
    if num_groups > 1:
        assert any(r["num_tokens"] >= MIN_TOKENS for r in prefill)
    if split_policy == "slo":
        # the decider ran at every step's start and again between its layer groups
        assert stats.extra["policy"]["num_decisions"] >= sum(r["layer_groups"] for r in prefill)


def test_decode_pieces_need_the_overlap_switch():
    from bullet_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="decode_pieces.*split_switch: overlap"):
        EngineConfig(model="dummy:tiny-llama", decode_pieces=2, split_switch="disjoint", split_policy="slo")
    assert EngineConfig(model="dummy:tiny-llama", decode_pieces=2, split_switch="disjoint").decode_pieces == 2  # unused
    with pytest.raises(ConfigError, match=r"decode_pieces.*\[1, 256\]"):
        EngineConfig(model="dummy:tiny-llama", decode_pieces=0)


def test_decode_pieces_follow_splits_requested_while_they_run(folder_and_expected, tmp_path):
    """Decode steps in 4 pieces (the slo policy, asynchronous scheduling) while a thread asks for another split
    every 2 ms: the greedy tokens stay transformers', both sides move, every KV block comes back, decode steps move
    between their pieces (`moved_while_launching` in the step log), and steps that a switch ran through are logged
    `across_switch` (the model does not learn from them)."""
    import time

    folder, expected = folder_and_expected
    log = tmp_path / "steps.jsonl"
    config = EngineConfig(model=folder, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                          split_policy="slo", async_scheduling=True, step_log_path=str(log), decode_pieces=4)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    with LLMEngine(config) as engine:
        with splits_requested(engine, 0.002) as seen:
            results = engine.generate(PROMPTS, params)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and engine.stats().num_free_kv_blocks != 64:
            time.sleep(0.05)
        stats = engine.stats()
    assert [r.token_ids for r in results] == expected
    assert stats.num_free_kv_blocks == 64
    assert len(seen["prefill"]) > 1 and len(seen["decode"]) > 1
    steps = [r for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "step"]
    decode = [r for r in steps if r["side"] == "decode"]
    assert decode and all(r["layer_groups"] == 4 for r in decode)
    assert any(r["across_switch"] for r in decode)
    # some moved between their pieces: each ends on the entry it moved to, and is never learned from
    moved = [r for r in decode if r.get("moved_while_launching")]
    assert moved and all(r["across_switch"] and r["runs_on"] is not None for r in moved)
    sites = Counter(r.get("site") for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "switch")
    print("switch sites:", dict(sites))  # with -s: where the acks came (piece, prep, sample, loop, launch ...)
