"""Reference attention in plain torch: the CPU path and the oracle every other backend is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bullet_ray.engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    """Gathers each sequence's K/V from the paged pool and runs scaled-dot-product attention on it."""

    name = "torch"

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                metadata: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        cache = self.kv_cache[layer]  # [num_blocks, 2, block_size, kv_heads, head_dim]
        _, _, block_size, kv_heads, head_dim = cache.shape
        # write the new tokens' K and V into their slots
        blk = metadata.slot_mapping // block_size
        off = metadata.slot_mapping % block_size
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)

        if out is None:
            out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(metadata.query_lens_list, metadata.seq_lens_list)):
            n_blocks = (ctx_len + block_size - 1) // block_size
            # one row gather of the sequence's blocks, K and V together (`cache[blocks, 0]`, an advanced index
            # beside a scalar one, took ~10x as long on CPU)
            kv = cache.index_select(0, metadata.block_tables[i, :n_blocks].long())  # [n, 2, block_size, kvh, d]
            keys = kv[:, 0].reshape(-1, kv_heads, head_dim)[:ctx_len]
            values = kv[:, 1].reshape(-1, kv_heads, head_dim)[:ctx_len]
            qi = q[start:start + q_len]
            out[start:start + q_len] = _attend(qi, keys.to(q.dtype), values.to(q.dtype), self.scale)
            start += q_len
        return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of q ([q_len, H, D], the last q_len positions) over k, v ([ctx_len, KVH, D])."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    mask = None
    if q_len > 1:
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device).unsqueeze(1)
        mask = torch.arange(ctx_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, ctx_len], True = attend
    # grouped-query heads share their K/V head inside the kernel (enable_gqa), no repeated copy of K and V
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1],
    )
    return o.squeeze(0).transpose(0, 1)
