"""ModelConfig: the architecture of a dense decoder, read from (and written back to) a HF config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bullet_ray.errors import ConfigError

# architecture name -> (model_type, has qkv bias, has q/k norm)
ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
_BY_TYPE = {mt: arch for arch, (mt, _, _) in ARCHITECTURES.items()}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or HF's rope scaling dict; rope_type "llama3" and "linear" are supported
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    # q/k/v projections carry a bias (always for Qwen2; Llama and Qwen3 when config.json says so, and then
    # o_proj has one too, as in transformers)
    attention_bias: bool = False
    # per-head RMSNorm on q and k before rotary (Qwen3)
    qk_norm: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ConfigError("architectures", f"unsupported architecture {self.architecture!r}; "
                              f"supported: {sorted(ARCHITECTURES)}")
        if self.hidden_act != "silu":
            raise ConfigError("hidden_act", f"only 'silu' is supported, got {self.hidden_act!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_key_value_heads", f"{self.num_key_value_heads} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.rope_scaling and self.rope_scaling.get("rope_type", "default") not in ("llama3", "linear", "default"):
            raise ConfigError("rope_scaling", f"unsupported rope_type in {self.rope_scaling}")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture][0]

    @property
    def o_proj_bias(self) -> bool:
        """o_proj carries a bias: transformers' Llama and Qwen3 tie it to attention_bias, Qwen2 never has one."""
        return self.attention_bias and self.model_type in ("llama", "qwen3")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_proj_bias:
            attn += h
        per_layer = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _BY_TYPE.get(d.get("model_type", ""), d.get("model_type", "?"))
        if arch not in ARCHITECTURES and d.get("model_type") in _BY_TYPE:
            arch = _BY_TYPE[d["model_type"]]
        if arch not in ARCHITECTURES:
            raise ConfigError("architectures", f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
        _, has_bias, has_qk_norm = ARCHITECTURES[arch]
        # transformers 5 writes rope_parameters (theta + scaling) instead of rope_theta / rope_scaling
        rope_params = d.get("rope_parameters") or {}
        theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
            scaling = None
        if scaling is not None:
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {
                "rope_type": scaling.get("rope_type", scaling.get("type"))}
        if d.get("mlp_bias"):
            raise ConfigError("mlp_bias", "MLP biases are not supported (no released Llama/Qwen model uses them)")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        heads = d["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=has_bias or (arch != "MistralForCausalLM" and bool(d.get("attention_bias", False))),
            qk_norm=has_qk_norm,
            hidden_act=d.get("hidden_act", "silu"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json that transformers and `from_hf_dict` both read back to the same model."""
        d = asdict(self)
        for key in ("architecture", "eos_token_ids", "extra", "qk_norm"):
            d.pop(key)
        d.update(architectures=[self.architecture], model_type=self.model_type,
                 eos_token_id=list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0])
        if self.eos_token_ids == ():
            d["eos_token_id"] = None
        if self.model_type == "mistral":
            d["sliding_window"] = None
        return d
