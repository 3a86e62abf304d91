"""The torch attention backend (the CPU path and every other backend's oracle) against attention written out by hand:
paged K/V in shuffled blocks, grouped-query heads, a mixed batch of prompt chunks over a cached prefix and decode rows."""

from __future__ import annotations

import random

import pytest
import torch

from bullet_ray.engine.attention.base import AttentionMetadata
from bullet_ray.engine.attention.torch_ref import TorchAttentionBackend


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last len(q) positions over k, v ([ctx, kv_heads, d]), each query head reading its
    group's K/V head, by matmul and softmax."""
    q_len, heads = q.shape[0], q.shape[1]
    ctx, kv_heads = k.shape[0], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1).float()
    v = v.repeat_interleave(heads // kv_heads, dim=1).float()
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    allowed = torch.arange(ctx).unsqueeze(0) <= torch.arange(ctx - q_len, ctx).unsqueeze(1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_paged_attention_equals_dense_attention_per_sequence(heads, kv_heads):
    rng = random.Random(heads * 10 + kv_heads)
    gen = torch.Generator().manual_seed(heads)
    block_size, head_dim = 4, 16
    query_lens = [1, 7, 1, 3, 1]  # decode rows and prompt chunks, the chunks over a cached prefix
    seq_lens = [9, 7, 20, 12, 1]
    num_blocks = sum((n + block_size - 1) // block_size for n in seq_lens) + 3
    order = list(range(num_blocks))
    rng.shuffle(order)  # each sequence's blocks scattered over the pool
    tables, slots, taken = [], [], 0
    for q_len, n in zip(query_lens, seq_lens):
        blocks = order[taken:taken + (n + block_size - 1) // block_size]
        taken += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n - q_len, n)]
    width = max(len(t) for t in tables)
    md = AttentionMetadata(torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
                           torch.tensor(seq_lens, dtype=torch.int32),
                           torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
                           torch.tensor(slots), list(query_lens), list(seq_lens), block_size)
    cache = torch.zeros(1, num_blocks, 2, block_size, kv_heads, head_dim)
    # each sequence's whole K/V; the cached prefix goes into the pool by hand, the new tokens through forward
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    for blocks, q_len, n, k, v in zip(tables, query_lens, seq_lens, keys, values):
        for p in range(n - q_len):
            cache[0, blocks[p // block_size], 0, p % block_size] = k[p]
            cache[0, blocks[p // block_size], 1, p % block_size] = v[p]
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen)
    new_k = torch.cat([k[n - q_len:] for k, q_len, n in zip(keys, query_lens, seq_lens)])
    new_v = torch.cat([v[n - q_len:] for v, q_len, n in zip(values, query_lens, seq_lens)])
    scale = head_dim ** -0.5
    out = TorchAttentionBackend(cache, heads, kv_heads, head_dim, scale).forward(0, q, new_k, new_v, md)
    start = 0
    for q_len, k, v in zip(query_lens, keys, values):
        torch.testing.assert_close(out[start:start + q_len], _dense(q[start:start + q_len], k, v, scale),
                                   rtol=1e-5, atol=1e-5)
        start += q_len
    for blocks, n, k in zip(tables, seq_lens, keys):  # every new token's K landed at its slot
        assert torch.equal(cache[0, blocks[(n - 1) // block_size], 0, (n - 1) % block_size], k[n - 1])
