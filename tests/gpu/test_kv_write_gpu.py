"""flashinfer's paged append kernel (`kv_write` "append", the default) writes the pool exactly as the `index_put_`
scatter does: K and V read in place from fused qkv rows, a mixed batch's scattered slots, eagerly and replayed from a
CUDA graph captured on other slots (the index is computed from the static slot buffer inside the graph)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, BS, LAYERS, BLOCKS = 8, 2, 128, 16, 3, 64


def _backend(kv_write: str, kv: torch.Tensor):
    from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(kv, HEADS, KV_HEADS, DIM, DIM ** -0.5, kv_write=kv_write)
    assert (backend._append_module is not None) == (kv_write == "append")
    return backend


def _fused(tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(LAYERS, tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16, generator=g)


def _split(row: torch.Tensor):
    k = row[:, HEADS * DIM:(HEADS + KV_HEADS) * DIM].view(-1, KV_HEADS, DIM)
    v = row[:, (HEADS + KV_HEADS) * DIM:].view(-1, KV_HEADS, DIM)
    return k, v


def _md(slots: torch.Tensor):
    md = type("Md", (), {})()
    md.slot_mapping = slots
    return md


def test_append_equals_scatter_eagerly():
    slots = torch.randperm(BLOCKS * BS, device="cuda")[:300]  # tokens of many sequences, any order
    qkv = _fused(300, 0)
    pools = {}
    for mode in ("append", "scatter"):
        backend = _backend(mode, torch.zeros(LAYERS, BLOCKS, 2, BS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16))
        md = _md(slots)
        for layer in range(LAYERS):
            backend.write_kv(layer, *_split(qkv[layer]), md)
        torch.cuda.synchronize()
        pools[mode] = backend.kv_cache
    assert torch.equal(pools["append"], pools["scatter"])
    assert pools["append"].abs().sum() > 0


def test_append_inside_a_cuda_graph_follows_the_static_slots():
    kv = torch.zeros(LAYERS, BLOCKS, 2, BS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    backend = _backend("append", kv)
    reference = _backend("scatter", kv.clone())
    slots = torch.zeros(32, dtype=torch.int64, device="cuda")
    qkv = torch.zeros(LAYERS, 32, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16)
    md = _md(slots)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up, then capture on slot 0 everywhere
        for layer in range(LAYERS):
            backend.write_kv(layer, *_split(qkv[layer]), md)
        backend.forget_batch()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for layer in range(LAYERS):
                backend.write_kv(layer, *_split(qkv[layer]), md)
    torch.cuda.current_stream().wait_stream(stream)
    for seed in (1, 2):
        new_slots = torch.randperm(BLOCKS * BS, device="cuda")[:32]
        slots.copy_(new_slots)
        qkv.copy_(_fused(32, seed))
        graph.replay()
        ref_md = _md(new_slots)
        for layer in range(LAYERS):
            reference.write_kv(layer, *_split(qkv[layer]), ref_md)
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            for mode_pool in (backend.kv_cache, reference.kv_cache):
                k_rows = mode_pool[layer][:, 0].reshape(-1, KV_HEADS, DIM)
                assert torch.equal(k_rows[new_slots], _split(qkv[layer])[0])
        assert torch.equal(backend.kv_cache, reference.kv_cache)
