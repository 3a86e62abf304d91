"""Worker start-up: load the model and create the shared weights, KV pool and state block, or attach to them."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.attention.base import get_backend_class
from bullet_ray.engine.kv_pool import SCRATCH_BLOCKS, KVPool, KVPoolHandle, kv_bytes_per_block
from bullet_ray.engine.shared_memory import TensorArena
from bullet_ray.engine.state_block import StateBlock, StateBlockHandle
from bullet_ray.engine.weights import WeightsHandle, allocate_shared_weights, attach_weights

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SharedHandles:
    """Everything the second worker maps from the first: sent through the engine front once."""

    model_config: dict  # ModelConfig.to_hf_dict()
    weights: WeightsHandle
    kv_pool: KVPoolHandle
    state: StateBlockHandle
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    tokenizer_path: str | None


@dataclass
class WorkerResources:
    """What a worker holds while it runs; `close()` releases it."""

    model: Any
    model_config: Any
    weights_arena: TensorArena
    kv_pool: KVPool
    state: StateBlock
    handles: SharedHandles
    device: torch.device
    backend: Any

    def close(self) -> None:
        self.kv_pool.close()
        self.state.close()
        self.weights_arena.close()


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _num_blocks(config: EngineConfig, model_config: Any, dtype: torch.dtype) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model_config.num_hidden_layers, model_config.num_key_value_heads,
                                   model_config.head_dim, config.block_size, dtype)
    return max(1, int(config.kv_cache_memory_gb * (1 << 30)) // per_block - SCRATCH_BLOCKS)  # the pool adds it


def _make_backend(config: EngineConfig, model_config: Any, kv_pool: KVPool) -> Any:
    cls = get_backend_class(config.attention_backend_name)
    return cls(kv_pool.kv_cache, model_config.num_attention_heads, model_config.num_key_value_heads,
               model_config.head_dim, model_config.head_dim ** -0.5)


def create_resources(config: EngineConfig, runtime_dir: str, device: torch.device) -> WorkerResources:
    """The first worker: load the model, move it to shared memory, create the pool and state block."""
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    dtype = _dtype(config.torch_dtype_name)
    source = resolve_source(config.model)
    model_config = source.config
    model = build_model(model_config, dtype=dtype, device="meta")
    # the weights are loaded straight into shared memory: no private copy ever exists
    arena, weights = allocate_shared_weights(model, str(device), runtime_dir)
    source.fill(model, True, config.seed)
    model.eval()
    num_blocks = _num_blocks(config, model_config, dtype)
    kv_pool = KVPool.create(num_layers=model_config.num_hidden_layers,
                            num_kv_heads=model_config.num_key_value_heads, head_dim=model_config.head_dim,
                            num_blocks=num_blocks, block_size=config.block_size, dtype=dtype,
                            device=str(device), runtime_dir=runtime_dir)
    state = StateBlock.create(os.path.join(runtime_dir, "state"))
    max_len = min(config.max_model_len or model_config.max_position_embeddings,
                  model_config.max_position_embeddings, num_blocks * config.block_size)
    handles = SharedHandles(model_config.to_hf_dict(), weights, kv_pool.export(), state.export(), max_len,
                            tuple(model_config.eos_token_ids), source.tokenizer_path)
    logger.info("loaded %s: %.1f MB of weights, %d KV blocks of %d tokens", config.model,
                weights.num_bytes / 1e6, num_blocks, config.block_size)
    return WorkerResources(model, model_config, arena, kv_pool, state, handles, device,
                           _make_backend(config, model_config, kv_pool))


def attach_resources(config: EngineConfig, handles: SharedHandles, device: torch.device) -> WorkerResources:
    """The second worker: build the model on the meta device and map the first worker's memory."""
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.registry import build_model

    model_config = ModelConfig.from_hf_dict(handles.model_config)
    model = build_model(model_config, dtype=_dtype(config.torch_dtype_name), device="meta")
    arena = attach_weights(model, handles.weights)
    model.eval()
    kv_pool = KVPool.attach(handles.kv_pool)
    state = StateBlock.attach(handles.state)
    return WorkerResources(model, model_config, arena, kv_pool, state, handles, device,
                           _make_backend(config, model_config, kv_pool))
