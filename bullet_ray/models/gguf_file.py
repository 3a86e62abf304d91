"""Read a GGUF file (llama.cpp format) into Hugging Face-named float32 tensors and a HF config dict.

Tensors are dequantized with the `gguf` package. llama.cpp stores Q and K projection rows of llama-arch
models permuted for its interleaved rotary layout; they are permuted back here.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from bullet_ray.errors import ModelLoadError

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.parts[field.data[0]]
    if value.dtype == np.uint8:
        return bytes(value).decode()
    return value.item() if value.size == 1 else value.tolist()


def hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    if base.startswith("blk."):
        _, idx, part = base.split(".", 2)
        if part not in _LAYER_NAMES:
            raise ModelLoadError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{idx}.{_LAYER_NAMES[part]}.{suffix}"
    if base not in _GLOBAL_NAMES:
        raise ModelLoadError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[base]}.{suffix}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert-time permutation of Q/K rows (interleaved -> rotate-half layout)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFModel:
    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        self.reader = gguf.GGUFReader(path)
        self.arch = _field(self.reader, "general.architecture")
        if self.arch not in ("llama", "qwen2", "qwen3"):
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported (llama, qwen2, qwen3)")

    def hf_config(self) -> dict:
        a, r = self.arch, self.reader
        heads = _field(r, f"{a}.attention.head_count")
        hidden = _field(r, f"{a}.embedding_length")
        names = {t.name for t in r.tensors}
        arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[a]
        return {
            "architectures": [arch_name], "model_type": a,
            "vocab_size": len(r.fields["tokenizer.ggml.tokens"].data),
            "hidden_size": hidden,
            "intermediate_size": _field(r, f"{a}.feed_forward_length"),
            "num_hidden_layers": _field(r, f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": _field(r, f"{a}.attention.head_count_kv", heads),
            "head_dim": _field(r, f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": _field(r, f"{a}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in names,
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
        }

    def tensors(self, show_progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf
        from tqdm import tqdm

        cfg = self.hf_config()
        for t in tqdm(self.reader.tensors, desc="dequantizing GGUF", disable=not show_progress, unit="tensor"):
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            w = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32)).reshape(shape)
            name = hf_name(t.name)
            if self.arch == "llama" and name.endswith("q_proj.weight"):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif self.arch == "llama" and name.endswith("k_proj.weight"):
                w = _unpermute(w, cfg["num_key_value_heads"])
            yield name, w
