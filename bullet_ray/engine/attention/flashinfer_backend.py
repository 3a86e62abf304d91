"""Paged attention on the GPU with flashinfer: ragged/paged prefill (incl. chunked) and paged decode.

The pool layout is flashinfer's paged NHD layout ([num_blocks, 2, block_size, kv_heads, head_dim] per
layer), so the kernels read the shared pool in place. New K/V are written with one indexed store per
layer; `begin_batch` plans the kernels once per step, `forward` runs them per layer.
"""

from __future__ import annotations

import torch

from bullet_ray.engine.attention.base import AttentionBackend, AttentionMetadata

_WORKSPACE_BYTES = 256 << 20


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, kv_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        import flashinfer

        device = kv_cache.device
        self.workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD")
        # the CUDA-core decode kernel, as the CUDA graphs use: a request gets the same tokens whether its
        # batch ran eagerly or through a graph
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, kv_layout="NHD",
                                                                    use_tensor_cores=False)
        self._is_decode = False

    def begin_batch(self, metadata: AttentionMetadata) -> None:
        bs = metadata.block_size
        seq_lens = metadata.seq_lens_list
        num_blocks = [(n + bs - 1) // bs for n in seq_lens]
        kv_indptr_list = [0]
        for n in num_blocks:
            kv_indptr_list.append(kv_indptr_list[-1] + n)
        dev = self.kv_cache.device
        counts = torch.tensor(num_blocks, dtype=torch.int32, device=dev)
        cols = torch.arange(metadata.block_tables.shape[1], device=dev, dtype=torch.int32)
        kv_indices = metadata.block_tables[cols[None, :] < counts[:, None]].to(torch.int32)
        kv_indptr = torch.tensor(kv_indptr_list, dtype=torch.int32)
        last_page_len = torch.tensor([(n - 1) % bs + 1 for n in seq_lens], dtype=torch.int32)
        dtype = self.kv_cache.dtype
        self._is_decode = metadata.is_decode
        if metadata.is_decode:
            self.decode.plan(kv_indptr.to(dev), kv_indices, last_page_len.to(dev), self.num_heads,
                             self.num_kv_heads, self.head_dim, bs, q_data_type=dtype, kv_data_type=dtype,
                             sm_scale=self.scale)
        else:
            qo_indptr = torch.tensor([0, *_cumsum(metadata.query_lens_list)], dtype=torch.int32)
            self.prefill.plan(qo_indptr.to(dev), kv_indptr.to(dev), kv_indices, last_page_len.to(dev),
                              self.num_heads, self.num_kv_heads, self.head_dim, bs, causal=True,
                              q_data_type=dtype, kv_data_type=dtype, sm_scale=self.scale)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        cache = self.kv_cache[layer]
        bs = cache.shape[2]
        blk = metadata.slot_mapping // bs
        off = metadata.slot_mapping % bs
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
        wrapper = self.decode if self._is_decode else self.prefill
        return wrapper.run(q.contiguous(), cache)


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
