"""Architecture name -> model class, imported lazily; `build_model` constructs one from a ModelConfig."""

from __future__ import annotations

import importlib

import torch
from torch import nn

from bullet_ray.errors import ConfigError
from bullet_ray.models.config import ModelConfig

_MODELS = {
    "LlamaForCausalLM": "bullet_ray.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "bullet_ray.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "bullet_ray.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "bullet_ray.models.llama:LlamaForCausalLM",
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ConfigError("architectures", f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}")
    module, attr = _MODELS[architecture].split(":")
    return getattr(importlib.import_module(module), attr)


def build_model(config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    """An uninitialized model (random or meta weights) of the config's architecture."""
    return get_model_class(config.architecture)(config, dtype=dtype, device=device)
