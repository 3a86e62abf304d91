"""Read a GGUF file (llama.cpp format) into Hugging Face-named float32 tensors and a HF config dict.

Tensors are dequantized with the `gguf` package. llama.cpp stores Q and K projection rows of llama-arch
models permuted for its interleaved rotary layout; they are permuted back here. Llama 3.x files carry their
llama3 rope scaling as a `rope_freqs` tensor (one divisor per frequency); it is turned back into HF's
`rope_scaling` dict and checked against the tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from bullet_ray.errors import ModelLoadError
from bullet_ray.models.layers import rope_inv_freq

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
    if value.dtype == np.float32 and value.size == 1:  # shortest decimal that round-trips: 1e-05, not 9.99e-06
        return float(str(value[0]))
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


def _llama3_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float, path: str) -> dict:
    """The HF llama3 rope_scaling dict whose per-frequency divisors equal llama.cpp's `rope_freqs`."""
    factor = float(np.max(rope_freqs))
    base = rope_inv_freq(head_dim, theta, None)
    # llama.cpp keeps only the divisors: assume HF's low/high freq factors 1 and 4 and solve for the original
    # context length from a frequency in the smoothed band (1 < divisor < factor), else try the usual ones
    candidates = [8192.0, 4096.0, 2048.0, 16384.0, 32768.0]
    medium = [i for i, d in enumerate(rope_freqs) if 1.0 + 1e-4 < d < factor * (1 - 1e-4)]
    if medium and factor > 1.0:
        i = medium[0]
        smooth = (1.0 / float(rope_freqs[i]) - 1.0 / factor) / (1.0 - 1.0 / factor)
        wavelen = 2 * np.pi / float(base[i])
        candidates.insert(0, round(wavelen * (smooth * 3.0 + 1.0)))
    for orig_len in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": int(orig_len)}
        divisors = (base / rope_inv_freq(head_dim, theta, scaling)).numpy()
        if divisors.shape == rope_freqs.shape and np.allclose(divisors, rope_freqs, rtol=1e-4):
            return scaling
    raise ModelLoadError(f"{path}: rope_freqs {rope_freqs.tolist()} does not match llama3 rope scaling "
                         "(low_freq_factor 1, high_freq_factor 4); this GGUF's rope scaling is not supported")


class GGUFModel:
    def __init__(self, path: str) -> None:
        import gguf

        self.path = path
        try:
            self.reader = gguf.GGUFReader(path)
        except Exception as e:  # the gguf package raises ValueError/struct errors/etc. on bad files
            raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
        self.arch = _field(self.reader, "general.architecture")
        if self.arch not in ("llama", "qwen2", "qwen3"):
            raise ModelLoadError(f"{path}: GGUF architecture {self.arch!r} is not supported (llama, qwen2, qwen3)")

    def hf_config(self) -> dict:
        a, r = self.arch, self.reader
        heads = _field(r, f"{a}.attention.head_count")
        hidden = _field(r, f"{a}.embedding_length")
        names = {t.name: t for t in r.tensors}
        if f"{a}.block_count" not in r.fields or "token_embd.weight" not in names:
            raise ModelLoadError(f"{self.path}: GGUF file lacks {a}.block_count or token_embd.weight")
        vocab = _field(r, f"{a}.vocab_size") or int(names["token_embd.weight"].shape[1])
        theta = float(_field(r, f"{a}.rope.freq_base", 10000.0))
        head_dim = _field(r, f"{a}.attention.key_length", hidden // heads)
        scaling = None
        if "rope_freqs.weight" in names:
            freqs = np.asarray(names["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
            scaling = _llama3_scaling(freqs, head_dim, theta, self.path)
        elif _field(r, f"{a}.rope.scaling.type") == "linear":
            scaling = {"rope_type": "linear", "factor": float(_field(r, f"{a}.rope.scaling.factor"))}
        elif _field(r, f"{a}.rope.scaling.type") not in (None, "none"):
            raise ModelLoadError(f"{self.path}: rope scaling {_field(r, f'{a}.rope.scaling.type')!r} is not "
                                 "supported (llama3 via rope_freqs, linear)")
        arch_name = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[a]
        return {
            "architectures": [arch_name], "model_type": a,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": _field(r, f"{a}.feed_forward_length"),
            "num_hidden_layers": _field(r, f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": _field(r, f"{a}.attention.head_count_kv", heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": theta,
            "rope_scaling": scaling,
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
            if t.name == "rope_freqs.weight":  # folded into the config's rope_scaling
                continue
            data = gguf.quants.dequantize(t.data, t.tensor_type)
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            w = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)  # a copy: the file is read-only
            name = hf_name(t.name)
            if self.arch == "llama" and name.endswith("q_proj.weight"):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif self.arch == "llama" and name.endswith("k_proj.weight"):
                w = _unpermute(w, cfg["num_key_value_heads"])
            yield name, w
