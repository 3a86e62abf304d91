"""The contract between a model's attention layers and the paged KV pool.

A batch is a list of sequences, each contributing `query_len` new tokens (a whole prompt, a chunk of one,
or one decode token) laid out back to back in one flat token tensor. Every sequence owns a list of KV
blocks (its block table); a new token at absolute position p lives at slot
`block_table[p // block_size] * block_size + p % block_size`. The backend writes the new keys and values
into the pool, then attends each query token to every cached token of its sequence at a position <= its
own (causal). The same call therefore serves prefill, chunked prefill, recompute after preemption, and
decode.

KV pool layout (one tensor, shared by the prefill and decode processes):
    kv_cache[layer] : [num_blocks, 2, block_size, num_kv_heads, head_dim]   (index 1: 0 = K, 1 = V)
which is flashinfer's paged "NHD" layout, so the GPU backend uses the pool without a copy.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    """Describes one batch for the attention backend. Built by the runner once per step."""

    # [num_seqs + 1] int32: query token offsets; sequence i owns tokens query_start_loc[i]:query_start_loc[i+1]
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length of each sequence after this step (cached + new tokens)
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks_per_seq] int32: block ids, padded with 0 past each sequence's blocks ([num_seqs, 0] for
    # a step a decode graph runs: it stages its own page indices, ModelRunner.on_graph)
    block_tables: torch.Tensor
    # [num_tokens] int64: pool slot of each new token (block * block_size + offset)
    slot_mapping: torch.Tensor
    # the same figures as Python lists, so CPU code never syncs on a tensor
    query_lens_list: list[int] = field(default_factory=list)
    seq_lens_list: list[int] = field(default_factory=list)
    block_size: int = 16
    # True when every sequence has query_len == 1 (a pure decode batch: CUDA graphs apply)
    is_decode: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_list)

    @classmethod
    def contiguous(cls, query_lens: list[int], seq_lens: list[int], block_size: int,
                   device: torch.device | str) -> AttentionMetadata:
        """A batch whose sequences own consecutive blocks from block 0 on, in batch order (kernel tests and
        benchmarks: the pool is filled by hand, no allocator)."""
        import torch

        tables: list[list[int]] = []
        slots: list[int] = []
        next_block = 0
        for q, n in zip(query_lens, seq_lens):
            blocks = list(range(next_block, next_block + (n + block_size - 1) // block_size))
            next_block += len(blocks)
            tables.append(blocks)
            slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
        width = max(len(t) for t in tables)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return cls(torch.tensor(qsl, dtype=torch.int32, device=device),
                   torch.tensor(seq_lens, dtype=torch.int32, device=device),
                   torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
                   torch.tensor(slots, dtype=torch.int64, device=device), list(query_lens), list(seq_lens),
                   block_size, all(q == 1 for q in query_lens))


class AttentionBackend(abc.ABC):
    """Computes paged attention for every layer of one model over one KV pool.

    Rules:
    - `forward` writes the batch's new K/V into `kv_cache[layer]` at `slot_mapping` before attending,
      so the tokens of one sequence see each other causally.
    - The backend never allocates or frees KV blocks; the block allocator owns them.
    - `begin_batch` is called once per step before the first layer; a backend may plan there
      (flashinfer builds its index buffers); `forward` is then called once per layer.
    """

    name: str = "abstract"

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def begin_batch(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Prepare for a batch (plan kernels, build index buffers). Default: nothing."""

    @abc.abstractmethod
    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads, head_dim]:
        `out` (contiguous, that shape) when given, which then holds the result (no copy from a temporary)."""


@dataclass
class AttentionContext:
    """What a model's forward needs besides token ids and positions: passed explicitly, never global."""

    backend: AttentionBackend
    metadata: AttentionMetadata


_BACKENDS = {
    "torch": "bullet_ray.engine.attention.torch_ref:TorchAttentionBackend",
    "flashinfer": "bullet_ray.engine.attention.flashinfer_backend:FlashInferBackend",
}


def get_backend_class(name: str) -> type[AttentionBackend]:
    """Return the backend class registered under `name`; unknown names list the known ones."""
    if name not in _BACKENDS:
        from bullet_ray.errors import ConfigError

        raise ConfigError("attention_backend", f"unknown backend {name!r}; known: {sorted(_BACKENDS)}")
    module, attr = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), attr)
