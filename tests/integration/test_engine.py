"""The engine end to end on CPU: worker processes, shared weights and KV, HF-identical greedy output.

References are Hugging Face transformers' greedy `generate` in float32 on the same weights. Every engine
here starts real worker processes (spawn), so each module keeps the number of engines small.
"""

from __future__ import annotations

import json
import os
from importlib.resources import files

import pytest
import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams

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
