"""A mixed step's decode rows on a second stream beside its prompt chunks' kernel (`mixed_overlap`) give the
same attention output as the two kernels one after the other, layer after layer, and leave the main stream
waiting for both (what the next piece reads)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, BS, LAYERS = 32, 8, 128, 16, 4


def test_overlapped_mixed_attention_equals_sequential():
    from bullet_ray.engine.attention.base import AttentionMetadata
    from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend

    torch.manual_seed(0)
    query_lens = [1] * 40 + [700, 150]
    seq_lens = [900 + 13 * i for i in range(40)] + [700, 2200]  # a fresh chunk, a chunk after a 2,050-token prefix
    md = AttentionMetadata.contiguous(query_lens, seq_lens, BS, "cuda")
    num_blocks = sum((n + BS - 1) // BS for n in seq_lens)
    kv = torch.randn(LAYERS, num_blocks, 2, BS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    t = md.num_tokens
    q = torch.randn(LAYERS, t, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(LAYERS, t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(LAYERS, t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for overlap in (False, True):
        backend = FlashInferBackend(kv.clone(), HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=True,
                                    mixed_overlap=overlap)
        with torch.inference_mode():
            backend.begin_batch(md)
            outs[overlap] = torch.stack([backend.forward(i, q[i], k[i], v[i], md) for i in range(LAYERS)]).float()
        assert backend._num_decode_rows == 40
    torch.cuda.synchronize()
    rel = float((outs[True] - outs[False]).norm() / outs[False].norm())
    assert rel < 1e-3, f"relative difference {rel:.2e}"
