"""Paged attention on the GPU with flashinfer: paged prefill (incl. chunked prefill over a cached prefix)
and paged decode.

The pool layout is flashinfer's paged NHD layout ([num_blocks, 2, block_size, kv_heads, head_dim] per
layer), so the kernels read the shared pool in place. New K/V are written with two `index_copy_` calls
per layer into the layer viewed as rows of [kv_heads, head_dim]; the row indices are computed once per
batch. `begin_batch` plans the kernels once per step (prefill/mixed batches: BatchPrefillWithPagedKVCache,
causal; pure decode batches: BatchDecodeWithPagedKVCache), `forward` runs them per layer. One workspace
buffer serves every wrapper and is allocated once.

Decode uses flashinfer's CUDA-core kernel eagerly as well as inside CUDA graphs (bullet_ray.engine.
cuda_graphs), so a sequence gets the same tokens whichever way its batch ran.
"""

from __future__ import annotations

import logging
import os

import torch

from bullet_ray.engine.attention.base import AttentionBackend, AttentionMetadata
from bullet_ray.models.gpu_kernels import PDL

logger = logging.getLogger(__name__)

# flashinfer's CuTe-DSL norm kernels need nvidia-cutlass-dsl; its CUDA JIT kernels need nothing more
os.environ.setdefault("FLASHINFER_USE_CUDA_NORM", "1")

WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        device = kv_cache.device
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD",
                                                                    use_tensor_cores=False)
        self._is_decode = False
        # rows of the new tokens' K and V in a layer viewed as [num_blocks * 2 * block_size, kv_heads, head_dim],
        # computed from the slot mapping at the first layer of each batch (`_rows_md` is that batch)
        self._rows_md: AttentionMetadata | None = None
        self._k_rows: torch.Tensor | None = None
        self._v_rows: torch.Tensor | None = None

    def begin_batch(self, metadata: AttentionMetadata) -> None:
        bs = metadata.block_size
        seq_lens = metadata.seq_lens_list
        num_blocks = [(n + bs - 1) // bs for n in seq_lens]
        kv_indptr = [0]
        for n in num_blocks:
            kv_indptr.append(kv_indptr[-1] + n)
        dev = self.kv_cache.device
        tables = metadata.block_tables
        if all(n == tables.shape[1] for n in num_blocks):
            kv_indices = tables.reshape(-1).to(torch.int32)
        else:
            counts = torch.tensor(num_blocks, dtype=torch.int32, device=dev)
            cols = torch.arange(tables.shape[1], device=dev, dtype=torch.int32)
            kv_indices = tables[cols[None, :] < counts[:, None]].to(torch.int32)
        indptr = torch.tensor(kv_indptr, dtype=torch.int32)
        last_page_len = torch.tensor([(n - 1) % bs + 1 for n in seq_lens], dtype=torch.int32)
        dtype = self.kv_cache.dtype
        self._is_decode = metadata.is_decode
        self._rows_md = None
        if metadata.is_decode:
            self.decode.plan(indptr.to(dev), kv_indices, last_page_len.to(dev), self.num_heads, self.num_kv_heads,
                             self.head_dim, bs, q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)
        else:
            qo_indptr = torch.tensor([0, *_cumsum(metadata.query_lens_list)], dtype=torch.int32)
            self.prefill.plan(qo_indptr.to(dev), indptr.to(dev), kv_indices, last_page_len.to(dev), self.num_heads, self.num_kv_heads,
                              self.head_dim, bs, causal=True, q_data_type=dtype, kv_data_type=dtype,
                              sm_scale=self.scale)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Store the batch's new K/V of one layer at their slots."""
        cache = self.kv_cache[layer]
        num_blocks, _, bs, kv_heads, head_dim = cache.shape
        if self._rows_md is not metadata or self._k_rows is None or self._v_rows is None:
            slots = metadata.slot_mapping
            self._k_rows = slots + torch.div(slots, bs, rounding_mode="floor") * bs
            self._v_rows = self._k_rows + bs
            self._rows_md = metadata
        k_rows, v_rows = self._k_rows, self._v_rows
        rows = cache.view(num_blocks * 2 * bs, kv_heads, head_dim)
        rows.index_copy_(0, k_rows, k.to(cache.dtype))
        rows.index_copy_(0, v_rows, v.to(cache.dtype))

    def forget_batch(self) -> None:
        """Drop what was derived from the last batch's metadata (a CUDA graph capture must recompute it)."""
        self._rows_md = None

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        self.write_kv(layer, k, v, metadata)
        wrapper = self.decode if self._is_decode else self.prefill
        return wrapper.run(q.contiguous(), self.kv_cache[layer], enable_pdl=PDL)


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
