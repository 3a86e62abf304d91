"""The engine end to end on CPU: worker processes, shared weights and KV, HF-identical greedy output.

References are Hugging Face transformers' greedy `generate` in float32 on the same weights. Every engine
here starts real worker processes (spawn), so each module keeps the number of engines small.
"""

from __future__ import annotations

import json
import os
import time
from importlib.resources import files

import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.policy.split import SplitTargets

pytestmark = pytest.mark.slow

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"]
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 250, 11], [300, 2, 71], list(range(40, 77)), [9] * 5 + [13, 14]]
NUM_NEW = 24


def _hf_folder(preset: str, root) -> str:
    """A Hugging Face folder with random weights for a tiny preset, written by transformers itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = os.path.join(root, preset)
    if not os.path.exists(folder):
        config = AutoConfig.for_model(**_preset(preset))
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
    return folder


def _preset(preset: str) -> dict:
    """The HF config of a tiny preset; Mistral is the Llama preset under Mistral's architecture."""
    name = "tiny-llama" if preset == "tiny-mistral" else preset
    cfg = json.loads((files("bullet_ray.models") / "presets" / f"{name}.json").read_text())
    if preset == "tiny-mistral":
        cfg.pop("rope_scaling", None)
        cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None)
    return cfg


def _hf_greedy(hf_greedy, folder: str, prompts: list[list[int]], num_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(model, ids, num_new) for ids in prompts]


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("hf_models"))


@pytest.mark.parametrize("schedule", ["bullet", "chunked"])
@pytest.mark.parametrize("preset", FAMILIES)
def test_greedy_matches_transformers(preset, schedule, hf_root, hf_greedy):
    folder = _hf_folder(preset, hf_root)
    expected = _hf_greedy(hf_greedy, folder, PROMPTS, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    # a small token budget forces chunked prompts and mixed batches in the chunked schedule
    config = EngineConfig(model=folder, schedule=schedule, num_kv_blocks=64, block_size=4,
                          max_num_batched_tokens=16)
    with LLMEngine(config) as engine:
        assert engine.stats().predicted_ttft_s is None  # no prefill step measured yet
        results = engine.generate(PROMPTS, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 64
        # measured prefill steps give a prediction; an idle engine's is about one step of an average prompt
        assert stats.predicted_ttft_s is not None and 0 < stats.predicted_ttft_s < 5
    assert [r.token_ids for r in results] == expected


def test_pool_too_small_preempts_and_still_matches(hf_root, hf_greedy):
    folder = _hf_folder("tiny-llama", hf_root)
    prompts = [list(range(10 + i, 30 + i)) for i in range(6)]
    expected = _hf_greedy(hf_greedy, folder, prompts, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # 6 requests x 40 tokens need 60 blocks of 4; the pool has 24
    config = EngineConfig(model=folder, num_kv_blocks=24, block_size=4, kv_watermark=0.0)
    with LLMEngine(config) as engine:
        results = engine.generate(prompts, params)
        stats = engine.stats()
        assert stats.num_free_kv_blocks == 24
        assert stats.num_preemptions > 0
    assert [r.token_ids for r in results] == expected


def test_split_policy_moves_the_split_and_keeps_the_tokens(hf_root, hf_greedy):
    """The bullet schedule with the SLO split policy (forced on for CPU, where partitions change nothing):
    the front asks for splits as decode steps are measured, both workers follow, tokens stay HF's."""
    folder = _hf_folder("tiny-llama", hf_root)
    expected = _hf_greedy(hf_greedy, folder, PROMPTS, NUM_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    # a TPOT target no CPU step misses: once a decode step is measured, decode needs the fewest SMs
    config = EngineConfig(model=folder, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
                          split_policy="slo", tpot_target_ms=60_000.0)
    def settled_split(engine):  # the growing side follows once the shrinking one acked
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(set(engine.split_indexes().values())) > 1:
            time.sleep(0.02)
        return engine.stats().extra["split"]

    with LLMEngine(config) as engine:
        results = engine.generate(PROMPTS, params)
        first = settled_split(engine)
        # now a TPOT target no step meets: decode must get the most SMs
        engine.split_policy.targets = SplitTargets(tpot_s=1e-6)
        again = engine.generate(PROMPTS, params)
        second = settled_split(engine)
        assert engine.stats().num_free_kv_blocks == 64
    assert [r.token_ids for r in results] == expected
    assert [r.token_ids for r in again] == expected
    # prefill alone first: all to prefill (index 0); decode steps measured there meet the target: stay
    assert first["requested"] == first["prefill"] == first["decode"] == 0 and first["decode_sms"][0] == 16
    assert first["num_requests"] >= 1 and first["full_gpu_decode_step_ms"] > 0
    top = len(second["decode_sms"]) - 1
    assert second["requested"] == top and second["decode"] == top  # both sides followed
    assert second["num_requests"] > first["num_requests"]
