"""GPU path of the engine (runs only with CUDA and flashinfer): flashinfer attention equals the torch
reference on paged inputs (prefill, chunked prefill, decode) and writes the same K/V (over several layers too,
where every layer after the first calls the kernels directly: DirectRun), CUDA-graph decode
(padded to its bucket, one graph per bucket across context lengths) equals eager decode, the fused
flashinfer layer kernels equal the PyTorch layers, and green-context partitions of the native helper have the SM counts they report."""

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

    return AttentionMetadata.contiguous(query_lens, seq_lens, block_size, "cuda")


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37, 5, 100], [37, 5, 100]),  # prefill
    ([16, 3], [50, 70]),  # chunked prefill over cached prefixes
    ([1, 1, 1, 1], [1, 17, 64, 200]),  # decode
    ([1, 20, 1, 7], [33, 20, 70, 90]),  # mixed, decode rows not first: all through the prefill kernel
    ([1, 1, 1, 20, 7], [33, 1, 70, 20, 90]),  # mixed, decodes first (the chunked schedule): decode + prefill kernels
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
    assert torch.equal(fi.kv_cache, ref.kv_cache.to(fi.kv_cache.dtype))  # same K/V at the same slots


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 1, 1], [9, 40, 130]), ([12, 1], [12, 50])])
def test_flashinfer_reads_fused_qkv_views(query_lens, seq_lens):
    """q, k, v as the model passes them (views into one fused qkv row): the decode kernel reads q with its
    strides and one scatter writes K and V; output and pool equal the contiguous path's."""
    fi, ref = _setup()
    md = _metadata(query_lens, seq_lens)
    qkv = torch.randn(sum(query_lens), (8 + 2 + 2) * 128, device="cuda", dtype=torch.bfloat16)
    q, k, v = (t.view(-1, n, 128) for t, n in zip(qkv.split([8 * 128, 2 * 128, 2 * 128], dim=-1), (8, 2, 2)))
    fi.begin_batch(md)
    out = fi.forward(0, q, k, v, md).float()
    ref.begin_batch(md)
    expected = ref.forward(0, q.contiguous(), k.contiguous(), v.contiguous(), md).float()
    rel = float((out - expected).norm() / expected.norm())
    assert rel < 2e-2, f"relative difference {rel:.4f}"
    assert torch.equal(fi.kv_cache, ref.kv_cache)


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("query_lens,seq_lens", [
    ([37, 5, 100], [37, 5, 100]),  # prefill: the ragged wrapper (the default prefill attention since m17)
    ([1, 1, 1, 1], [1, 17, 64, 200]),  # decode: the decode wrapper
    ([1, 1, 1, 20, 7], [33, 1, 70, 20, 90]),  # mixed, decodes first: both
])
def test_later_layers_call_the_kernels_directly_and_agree(query_lens, seq_lens, tensor_cores):
    """Every layer after a plan's first goes through DirectRun's recorded call: each layer's output (written
    into the caller's buffer) and K/V still equal the torch reference's."""
    from bullet_ray.engine.attention.base import get_backend_class

    layers, t = 3, sum(query_lens)
    kv = torch.randn(layers, 64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    args = (8, 2, 128, 128 ** -0.5)
    fi = get_backend_class("flashinfer")(kv, *args, decode_tensor_cores=tensor_cores)
    ref = get_backend_class("torch")(kv.clone(), *args)
    md = _metadata(query_lens, seq_lens)
    fi.begin_batch(md)
    for layer in range(layers):
        q = torch.randn(t, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(t, 2, 128, device="cuda", dtype=torch.bfloat16)
        out = torch.full_like(q, float("nan"))
        got = fi.forward(layer, q, k, v, md, out=out)
        assert got is out
        expected = ref.forward(layer, q.float(), k.float(), v.float(), md).float()
        rel = float((out.float() - expected).norm() / expected.norm())
        assert rel < 2e-2, f"layer {layer}: relative difference {rel:.4f}"
    assert torch.equal(fi.kv_cache, ref.kv_cache.to(fi.kv_cache.dtype))
    used = [fi._direct[id(w)] for w in (fi.decode, fi.prefill, fi.ragged) if w is not None and id(w) in fi._direct]
    assert used and all(d.usable and d.direct_calls == layers - 1 for d in used)


def _decode_inputs(seq_lens, first_id=3):
    """A decode batch over `seq_lens` (one token a row, each row's pages of 16 next to the last row's from page 0):
    its metadata, input ids (first_id, first_id + 1, ...), positions and page tables."""
    n = len(seq_lens)
    md = _metadata([1] * n, seq_lens)
    ids = torch.arange(first_id, first_id + n, device="cuda")
    pos = torch.tensor([s - 1 for s in seq_lens], device="cuda")
    tables, nxt = [], 0
    for s in seq_lens:
        tables.append(list(range(nxt, nxt + (s + 15) // 16)))
        nxt += len(tables[-1])
    return md, ids, pos, tables


def _tiny_model(num_layers=2):
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.loader import init_dummy_weights, preset_hf_config
    from bullet_ray.models.registry import build_model

    hf = preset_hf_config("tiny-llama")
    hf.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
              num_hidden_layers=num_layers)
    cfg = ModelConfig.from_hf_dict(hf)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda")
    init_dummy_weights(model, 0)
    return model, cfg


@pytest.mark.parametrize("scratch", [False, True])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("seq_lens", [[5, 20, 33], [17], [40, 1, 300, 64, 9],
                                      [1 + (37 * i) % 45 for i in range(300)]])  # past 256 rows: the 320 bucket
def test_graph_decode_equals_eager(seq_lens, tensor_cores, scratch):
    """Graph replay (batch padded to its bucket) gives the eager hidden states and writes the same KV (each
    row's new token in every layer too), whether the padding rows write row 0's slot (row 0 last) or a scratch
    block's (the pool's last block here, as KVPool keeps one); padding rows touch no other block outside the
    batch. With either decode kernel (CUDA-core, tensor-core), up to the offline buckets past 256."""
    from bullet_ray.engine.attention.base import AttentionContext, get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    model, cfg = _tiny_model()
    n = len(seq_lens)
    num_blocks = max(64, sum((s + 15) // 16 for s in seq_lens) + 8)
    kv = torch.randn(cfg.num_hidden_layers, num_blocks, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5, decode_tensor_cores=tensor_cores)
    graphs = DecodeGraphs(model, backend, 16, max(8, n), 32, torch.device("cuda"),
                          scratch_slot=(num_blocks - 1) * 16 if scratch else None)
    md, ids, pos, tables = _decode_inputs(seq_lens)
    nxt = sum(len(t) for t in tables)  # the first block after the batch's
    saved = kv.clone()
    with torch.inference_mode():
        backend.begin_batch(md)
        eager = model.forward(ids, pos, AttentionContext(backend, md)).float()
        eager_kv = kv.clone()
        for _ in range(2):  # the first call captures (and replays), the second replays the captured graph
            kv.copy_(saved)
            graph = graphs.run(0, ids, pos, md, tables).float()
            assert graph.shape == eager.shape
            rel = float((graph - eager).norm() / eager.norm())
            assert rel < 1e-2, f"relative difference {rel:.4f}"
    assert torch.equal(kv[:, nxt:num_blocks - 1], saved[:, nxt:num_blocks - 1])  # blocks outside the batch untouched
    padded = graphs.bucket(n) > n
    assert torch.equal(kv[:, -1], saved[:, -1]) == (not (scratch and padded))  # the scratch block: padding only
    own = slice(0, num_blocks - 1)  # the scratch block (written by padding rows only) apart
    assert float((kv[:, own].float() - eager_kv[:, own].float()).norm() / eager_kv[:, own].float().norm()) < 1e-2
    for i, s in enumerate(seq_lens):  # every row's new K/V in every layer, row 0's against the padding rows'
        block, off = tables[i][(s - 1) // 16], (s - 1) % 16
        new, ref = kv[:, block, :, off].float(), eager_kv[:, block, :, off].float()
        assert float((new - ref).norm() / ref.norm()) < 1e-2, f"row {i}'s K/V"
    assert graphs.num_captures == 1


def test_balanced_split_decode_equals_the_unsplit_plan_in_graphs_and_eagerly():
    """From SPLIT_KV_MAX_ROWS rows the tensor-core decode splits only its longest rows (`decode_plan_options`):
    a batch with one long row beside short ones, at 32 rows, at 27 (padded to the bucket of 32) and at 16, through the
    decode graphs (both variants of each bucket captured at start, none while serving) and eagerly, gives the
    hidden states of the plan without a split; rows alike take the unsplit graph."""
    from bullet_ray.engine.attention.base import AttentionContext, get_backend_class
    from bullet_ray.engine.attention.flashinfer_backend import SPLIT_KV_MAX_ROWS
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    model, cfg = _tiny_model()
    num_blocks = 512
    kv = torch.randn(cfg.num_hidden_layers, num_blocks, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5, decode_tensor_cores=True)
    assert backend.decode_split_kv_rows == SPLIT_KV_MAX_ROWS == 16
    graphs = DecodeGraphs(model, backend, 16, 64, 160, torch.device("cuda"))
    graphs.capture_all(0)
    assert graphs.num_captures == len(graphs.buckets) + sum(1 for b in graphs.buckets if b >= SPLIT_KV_MAX_ROWS)
    graphs.is_serving = True
    with torch.inference_mode():
        for seq_lens in ([40] * 31 + [2200], [2000] + [33 + i for i in range(26)], [130] * 32, [40] * 15 + [1900]):
            n = len(seq_lens)
            pages = [(s + 15) // 16 for s in seq_lens]
            split = backend.decode_plan_options(pages)
            assert ("fixed_split_size" in split) == (len(set(seq_lens)) > 1), split
            md = _metadata([1] * n, seq_lens)
            ids = torch.arange(3, 3 + n, device="cuda")
            pos = torch.tensor([s - 1 for s in seq_lens], device="cuda")
            tables, nxt = [], 0
            for p in pages:
                tables.append(list(range(nxt, nxt + p)))
                nxt += p
            saved = kv.clone()
            outs = {}
            for limit in (0, SPLIT_KV_MAX_ROWS):  # no split, then the balanced one
                backend.decode_split_kv_rows = limit
                kv.copy_(saved)
                backend.begin_batch(md)
                outs[f"eager{limit}"] = model.forward(ids, pos, AttentionContext(backend, md)).float()
                kv.copy_(saved)
                outs[f"graph{limit}"] = graphs.run(0, ids, pos, md, tables).float()
            ref = outs["eager0"]
            for name, out in outs.items():
                rel = float((out - ref).norm() / ref.norm())
                assert rel < 1e-2, f"{name} at {n} rows: relative difference {rel:.4f}"
    assert graphs.num_captures_serving == 0 and not graphs.unsplit_buckets


def _graph_vs_eager(model, backend, graphs, kv, lens, partition_key=0) -> float:
    """One decode step of rows at `lens` (pages numbered from 0, row after row) eagerly, then through `graphs`
    from the same KV: the relative difference of the hidden states."""
    from bullet_ray.engine.attention.base import AttentionContext

    n = len(lens)
    md = _metadata([1] * n, lens)
    tables, nxt = [], 0
    for s in lens:
        tables.append(list(range(nxt, nxt + (s + 15) // 16)))
        nxt += len(tables[-1])
    ids = torch.arange(5, 5 + n, device="cuda")
    pos = torch.tensor([s - 1 for s in lens], device="cuda")
    saved = kv.clone()
    backend.begin_batch(md)
    eager = model.forward(ids, pos, AttentionContext(backend, md)).float()
    kv.copy_(saved)
    graph = graphs.run(partition_key, ids, pos, md, tables).float()
    return float((graph - eager).norm() / eager.norm())


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_graph_is_reused_across_context_lengths(tensor_cores):
    """One graph per bucket serves growing contexts (in graph mode either decode kernel's plan depends on
    the batch size alone); every replay equals eager."""
    from bullet_ray.engine.attention.base import get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    model, cfg = _tiny_model()
    kv = torch.randn(cfg.num_hidden_layers, 128, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5, decode_tensor_cores=tensor_cores)
    graphs = DecodeGraphs(model, backend, 16, 4, 64, torch.device("cuda"))
    with torch.inference_mode():
        for lens in ([10, 30, 3], [90, 200, 17], [400, 31, 900]):
            assert _graph_vs_eager(model, backend, graphs, kv, lens, partition_key=1) < 1e-2
    assert graphs.num_captures == 1


@pytest.mark.parametrize("scratch", [False, True])
def test_reused_decode_plans_equal_eager_between_buckets(scratch):
    """Tensor-core decode graphs skip flashinfer's plan where it cannot change (`plan_key`): 16 rows alike (the
    unsplit plan) grow over 20 steps, crossing page boundaries, with a step of 3 rows (another bucket, which
    rewrites the shared page-table buffers) and a split batch of 16 (the same bucket's other plan) between them;
    every replay equals eager, and most steps reuse their bucket's last plan."""
    from bullet_ray.engine.attention.base import get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    model, cfg = _tiny_model()
    num_blocks = 256
    kv = torch.randn(cfg.num_hidden_layers, num_blocks, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5, decode_tensor_cores=True)
    graphs = DecodeGraphs(model, backend, 16, 16, 64, torch.device("cuda"),
                          scratch_slot=(num_blocks - 1) * 16 if scratch else None)
    graphs.capture_all(0)
    graphs.is_serving = True

    def step(lens):
        rel = _graph_vs_eager(model, backend, graphs, kv, lens)
        assert rel < 1e-2, f"{len(lens)} rows at {lens[:3]}...: relative difference {rel:.4f}"

    with torch.inference_mode():
        before = graphs.num_plans
        for t in range(20):
            step([10 + t + (i % 2) * 16 for i in range(16)])  # rows of 1-3 pages, none standing out: unsplit
            if t == 7:
                step([30, 3, 200])  # the 4 bucket
            if t == 13:
                step([40] * 15 + [700])  # one row stands out: the 16 bucket's split plan
    assert graphs.num_captures_serving == 0
    # the unsplit 16 bucket plans at t=0 (capture_all left it on its split plan) and after the split step only
    assert graphs.num_plans_reused >= 17
    assert graphs.num_plans - before <= 4


def test_fused_kernels_match_the_pytorch_layers():
    """RMSNorm, SiLU-and-mul and rotary through flashinfer equal the layers' own PyTorch code."""
    import os

    from bullet_ray.models import gpu_kernels
    from bullet_ray.models.layers import RMSNorm, RotaryEmbedding

    x = torch.randn(37, 512, device="cuda", dtype=torch.bfloat16)
    norm = RMSNorm(512, 1e-5, torch.bfloat16, "cuda")
    norm.weight.data.normal_(1.0, 0.1)
    fused = gpu_kernels.rms_norm(x, norm.weight, 1e-5)
    os.environ["BULLET_RAY_DISABLE_FUSED_KERNELS"] = "1"
    gpu_kernels._flashinfer.cache_clear()
    try:
        ref_norm = norm(x)
        rot = RotaryEmbedding(128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                              "cuda")
        qkv = torch.randn(37, (8 + 2 + 2) * 128, device="cuda", dtype=torch.bfloat16)
        pos = torch.randint(0, 100000, (37,), device="cuda")
        q, k = qkv[:, :1024].view(37, 8, 128), qkv[:, 1024:1280].view(37, 2, 128)
        ref_q, ref_k = rot(pos, q, k)
        gu = torch.randn(37, 2 * 256, device="cuda", dtype=torch.bfloat16)
        from bullet_ray.models.layers import silu_and_mul

        ref_act = silu_and_mul(gu)
    finally:
        del os.environ["BULLET_RAY_DISABLE_FUSED_KERNELS"]
        gpu_kernels._flashinfer.cache_clear()
    assert fused is not None
    assert float((fused.float() - ref_norm.float()).norm() / ref_norm.float().norm()) < 1e-2
    out = gpu_kernels.rope_inplace(rot, pos, q, k)
    assert out is not None
    assert float((q.float() - ref_q.float()).norm() / ref_q.float().norm()) < 1e-2
    assert float((k.float() - ref_k.float()).norm() / ref_k.float().norm()) < 1e-2
    act = gpu_kernels.silu_and_mul(gu)
    assert act is not None and float((act.float() - ref_act.float()).norm() / ref_act.float().norm()) < 1e-2


def test_green_partitions_report_their_sm_counts():
    from bullet_ray.gpu.partition import GreenPartitioner

    p = GreenPartitioner("both", 0, [16, 64])
    assert [e.decode_sms for e in p.ladder] == [16, 64]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(e.decode_sms + e.prefill_sms == sms for e in p.ladder)
    assert p.stream(0, "decode") is not None and p.stream(1, "prefill") is not None
    p.close()


@pytest.mark.parametrize("keep_target", [True, False])
def test_decode_graphs_on_a_partition_tune_the_cublas_sm_target_and_equal_eager(monkeypatch, keep_target):
    """On a 16-SM green partition every bucket is captured with and without cuBLAS aimed at 16 SMs and one is
    kept (forced here either way): the kept graph gives the eager hidden states on that stream, each choice is
    recorded with both timings, and PyTorch's BLAS library and SM carveout are back as they were."""
    from bullet_ray.engine import gemm_target
    from bullet_ray.engine.attention.base import AttentionContext, get_backend_class
    from bullet_ray.engine.cuda_graphs import DecodeGraphs
    from bullet_ray.gpu.partition import GreenPartitioner

    monkeypatch.setattr(gemm_target, "keeps_target", lambda plain, targeted: keep_target)
    library, carveout = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    p = GreenPartitioner("decode", 0, [16])
    try:
        stream = p.stream(0, "decode")
        model, cfg = _tiny_model()
        kv = torch.randn(cfg.num_hidden_layers, 64, 2, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
        backend = get_backend_class("flashinfer")(kv, 4, 2, 128, 128 ** -0.5)
        graphs = DecodeGraphs(model, backend, 16, 8, 32, torch.device("cuda"))
        graphs.partition_sms = {0: p.ladder[0].decode_sms}
        assert graphs.tune_sm_target
        graphs.capture_all(0, stream)
        assert torch.backends.cuda.preferred_blas_library() == library
        assert torch._C._get_sm_carveout_experimental() == carveout
        assert sorted(b for _, b in graphs.sm_target_choices) == list(graphs.buckets)
        assert all(plain > 0 and targeted > 0 and kept is keep_target
                   for plain, targeted, kept in graphs.sm_target_choices.values())
        assert graphs.num_captures == 2 * len(graphs.buckets) and len(graphs.graphs) == len(graphs.buckets)
        assert graphs.capture_report()["sm_target"]["kept"] == (len(graphs.buckets) if keep_target else 0)
        seq_lens = [5, 20, 33]
        md = _metadata([1] * 3, seq_lens)
        ids, pos = torch.arange(3, 6, device="cuda"), torch.tensor([s - 1 for s in seq_lens], device="cuda")
        tables = [[0], [1, 2], [3, 4, 5]]
        saved = kv.clone()
        graphs.is_serving = True
        with torch.inference_mode(), torch.cuda.stream(stream):
            backend.begin_batch(md)
            eager = model.forward(ids, pos, AttentionContext(backend, md)).float()
            kv.copy_(saved)
            graph = graphs.run(0, ids, pos, md, tables).float()
        stream.synchronize()
        assert float((graph - eager).norm() / eager.norm()) < 1e-2
        assert graphs.num_captures_serving == 0 and graphs.num_captures == 2 * len(graphs.buckets)
    finally:
        p.close()
