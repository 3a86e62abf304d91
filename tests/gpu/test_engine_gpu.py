"""GPU path of the engine (runs only with CUDA and flashinfer): flashinfer attention equals the torch
reference on paged inputs (prefill, chunked prefill, decode), CUDA-graph decode equals eager decode, and
green-context partitions of the native helper have the SM counts they report."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _setup(num_heads=8, num_kv_heads=2, head_dim=128, num_blocks=64, block_size=16):
    from bullet_ray.engine.attention.base import get_backend_class

    kv = torch.randn(1, num_blocks, 2, block_size, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    args = (num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    return (get_backend_class("flashinfer")(kv, *args), get_backend_class("torch")(kv.clone(), *args))


def _metadata(query_lens, seq_lens, block_size=16):
    from bullet_ray.engine.attention.base import AttentionMetadata

    tables, slots, next_block = [], [], 0
    for q, n in zip(query_lens, seq_lens):
        blocks = list(range(next_block, next_block + (n + block_size - 1) // block_size))
        next_block += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n - q, n)]
    width = max(len(t) for t in tables)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    dev = "cuda"
    return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32, device=dev),
                             torch.tensor(seq_lens, dtype=torch.int32, device=dev),
                             torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
                             torch.tensor(slots, dtype=torch.int64, device=dev), list(query_lens), list(seq_lens),
                             block_size, all(q == 1 for q in query_lens))


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37, 5, 100], [37, 5, 100]),  # prefill
    ([16, 3], [50, 70]),  # chunked prefill over cached prefixes
    ([1, 1, 1, 1], [1, 17, 64, 200]),  # decode
])
def test_flashinfer_matches_the_torch_reference(query_lens, seq_lens):
    fi, ref = _setup()
    md = _metadata(query_lens, seq_lens)
    t = sum(query_lens)
    q = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16)
    fi.begin_batch(md)
    out = fi.forward(0, q, k, v, md).float()
    expected = ref.forward(0, q.float(), k.float(), v.float(), md).float()
    rel = float((out - expected).norm() / expected.norm())
    assert rel < 2e-2, f"relative difference {rel:.4f}"


def test_graph_decode_equals_eager():
    from bullet_ray.engine.attention.base import AttentionContext, get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.loader import init_dummy_weights, preset_hf_config
    from bullet_ray.models.registry import build_model

    hf = preset_hf_config("tiny-llama")
    hf.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    cfg = ModelConfig.from_hf_dict(hf)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda")
    init_dummy_weights(model, 0)
    kv = torch.randn(cfg.num_hidden_layers, 64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5)
    graphs = DecodeGraphs(model, backend, 16, 8, 8, torch.device("cuda"))
    md = _metadata([1, 1, 1], [5, 20, 33])
    ids = torch.tensor([3, 4, 5], device="cuda")
    pos = torch.tensor([4, 19, 32], device="cuda")
    tables = [[0], [1, 2], [3, 4, 5]]
    saved = kv.clone()
    backend.begin_batch(md)
    eager = model.forward(ids, pos, AttentionContext(backend, md)).float()
    kv.copy_(saved)
    graph = graphs.run(0, ids, pos, md, tables).float()
    rel = float((graph - eager).norm() / eager.norm())
    assert rel < 1e-2, f"relative difference {rel:.4f}"


def test_green_partitions_report_their_sm_counts():
    from bullet_ray.gpu.partition import GreenPartitioner

    p = GreenPartitioner("both", 0, [16, 64])
    assert [e.decode_sms for e in p.ladder] == [16, 64]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(e.decode_sms + e.prefill_sms == sms for e in p.ladder)
    assert p.stream(0, "decode") is not None and p.stream(1, "prefill") is not None
    p.close()
