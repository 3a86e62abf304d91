"""Our decoder implementations against Hugging Face transformers (float32, CPU), one tiny random model per
family, saved with save_pretrained and read back through our HF-folder loader; plus the embedded SmolLM2."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

from bullet_ray.models.loader import load_model
from bullet_ray.models.testing import greedy_generate, prefill_logits
from tests.hf_random import random_hf_model

PROMPTS = [[1, 17, 300, 42, 9, 255, 77, 5, 88, 130, 64], [1, 400, 23]]
NUM_NEW_TOKENS = 16


def _preset(name: str) -> dict:
    return json.loads((files("bullet_ray.models") / "presets" / f"{name}.json").read_text())


def _mistral() -> dict:
    d = _preset("tiny-llama")
    d.pop("rope_scaling")
    d.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None, rope_theta=10000.0)
    return d


def _llama_bias_tied() -> dict:
    return {**_preset("tiny-llama"), "attention_bias": True, "tie_word_embeddings": True}


FAMILIES = {
    # name: (HF config dict, seed). Seeds were checked for near-ties (see _assert_no_near_tie).
    "llama-llama3-rope-untied": (_preset("tiny-llama"), 0),
    "qwen2-bias-untied": (_preset("tiny-qwen2"), 0),
    "qwen3-qknorm-tied": (_preset("tiny-qwen3"), 0),
    "mistral": (_mistral(), 0),
    "llama-llama3-rope-bias-tied": (_llama_bias_tied(), 0),  # transformers' Llama: q/k/v AND o_proj biases
}


def _hf_model(config: dict, seed: int = 0):
    return random_hf_model(config, seed)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, HF model, our loaded model) with the same weights, ours read from a save_pretrained folder."""
    config, seed = FAMILIES[request.param]
    hf = _hf_model(config, seed)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    loaded = load_model(str(folder), show_progress=False)
    return request.param, hf, loaded


def test_config_flags_follow_family(family):
    name, hf, loaded = family
    c = loaded.config
    assert c.tie_word_embeddings == name.endswith("-tied")
    assert c.attention_bias == ("-bias" in name)
    assert c.o_proj_bias == (name.startswith("llama") and "-bias" in name)
    assert c.qk_norm == ("-qknorm" in name)
    assert (c.rope_scaling or {}).get("rope_type") == ("llama3" if "llama3-rope" in name else None)
    assert sum(p.numel() for p in loaded.model.parameters()) == c.num_params == hf.num_parameters()


def test_prefill_logits_match_hf(family):
    _, hf, loaded = family
    ours = prefill_logits(loaded.model, PROMPTS, block_size=4)  # both prompts in one ragged batch
    with torch.no_grad():
        for prompt, logits in zip(PROMPTS, ours):
            ref = hf(torch.tensor([prompt])).logits[0].float()
            assert logits.shape == ref.shape
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _assert_no_near_tie(hf, prompt: list[int], continuation: list[int]) -> None:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + continuation[:-1]])).logits[0, len(prompt) - 1:]
    top2 = logits.topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    assert gap > 1e-5, f"near-tie in the HF reference (top-2 gap {gap:.2e}): pick another seed"


def test_greedy_batched_matches_hf(family, hf_greedy):
    _, hf, loaded = family
    ours = greedy_generate(loaded.model, PROMPTS, NUM_NEW_TOKENS, block_size=4)
    for prompt, tokens in zip(PROMPTS, ours):
        ref = hf_greedy(hf, prompt, NUM_NEW_TOKENS)
        _assert_no_near_tie(hf, prompt, ref)
        assert tokens == ref


def test_single_prompt_equals_batched(family):
    _, _, loaded = family
    batched = greedy_generate(loaded.model, PROMPTS, 8, block_size=4)
    for prompt, tokens in zip(PROMPTS, batched):
        assert greedy_generate(loaded.model, prompt, 8, block_size=16) == tokens


def test_meta_device_build_has_no_storage():
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.registry import build_model

    config = ModelConfig.from_hf_dict(_preset("tiny-qwen3"))
    model = build_model(config, device="meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary caches are computed, never loaded
    names = {n for n, _ in model.named_parameters()}
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert "lm_head.weight" not in names  # tied


# --- the embedded model ---------------------------------------------------------------------------------

SMOLLM_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
]
SMOLLM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def smollm2():
    """Our embedded SmolLM2 (cached HF folder), its tokenizer, and transformers' own load of the GGUF."""
    import os

    from transformers import AutoModelForCausalLM

    from bullet_ray.models.loader import embedded_gguf_path

    loaded = load_model("smollm2-135m-instruct", show_progress=False)
    gguf = embedded_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32).eval()
    return loaded, loaded.load_tokenizer(), hf


@pytest.mark.slow
def test_smollm2_greedy_matches_hf(smollm2, hf_greedy):
    loaded, tokenizer, hf = smollm2
    prompts = [tokenizer(p)["input_ids"] for p in SMOLLM_PROMPTS]
    ours = greedy_generate(loaded.model, prompts, SMOLLM_NEW_TOKENS, block_size=16)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf, prompt, SMOLLM_NEW_TOKENS)


@pytest.mark.slow
def test_smollm2_answers_capital_of_france(smollm2):
    loaded, tokenizer, _ = smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(prompt, list):  # transformers 5 may return a BatchEncoding
        prompt = prompt["input_ids"]
    answer = tokenizer.decode(greedy_generate(loaded.model, list(prompt), 12), skip_special_tokens=True)
    assert answer.startswith("The capital of France is Paris."), answer
