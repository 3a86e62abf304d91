"""A mixed step's attention in its three modes (`mixed_attention`): the decode rows on a second stream beside the
prompt chunks' kernel ("overlap") give the same output as the two kernels one after the other ("split"), layer
after layer, and leave the main stream waiting for both (what the next piece reads); every row in one persistent
kernel ("holistic") equals the torch reference and the split kernels up to bf16 rounding, planned again without a
device sync, with the batch's q read in place from fused qkv rows."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, DIM, BS, LAYERS = 32, 8, 128, 16, 4
QUERY_LENS = [1] * 40 + [700, 150]
SEQ_LENS = [900 + 13 * i for i in range(40)] + [700, 2200]  # a fresh chunk, a chunk after a 2,050-token prefix


def _inputs():
    from bullet_ray.engine.attention.base import AttentionMetadata

    torch.manual_seed(0)
    md = AttentionMetadata.contiguous(QUERY_LENS, SEQ_LENS, BS, "cuda")
    num_blocks = sum((n + BS - 1) // BS for n in SEQ_LENS)
    kv = torch.randn(LAYERS, num_blocks, 2, BS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    t = md.num_tokens
    q = torch.randn(LAYERS, t, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(LAYERS, t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(LAYERS, t, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    return md, kv, q, k, v


def _layers(mode: str, md, kv, q, k, v):
    from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend

    backend = FlashInferBackend(kv.clone(), HEADS, KV_HEADS, DIM, DIM ** -0.5, decode_tensor_cores=True,
                                mixed_attention=mode)
    with torch.inference_mode():
        backend.begin_batch(md)
        out = torch.stack([backend.forward(i, q[i], k[i], v[i], md) for i in range(LAYERS)]).float()
    torch.cuda.synchronize()
    return backend, out


def test_overlapped_mixed_attention_equals_sequential():
    inputs = _inputs()
    split_backend, split = _layers("split", *inputs)
    overlap_backend, overlap = _layers("overlap", *inputs)
    assert split_backend._num_decode_rows == overlap_backend._num_decode_rows == 40
    rel = float((overlap - split).norm() / split.norm())
    assert rel < 1e-3, f"relative difference {rel:.2e}"


def test_holistic_mixed_attention_equals_the_split_kernels():
    inputs = _inputs()
    _, split = _layers("split", *inputs)
    backend, holistic = _layers("holistic", *inputs)
    assert backend._holistic_planned
    rel = float((holistic - split).norm() / split.norm())
    assert rel < 1e-2, f"relative difference {rel:.2e}"
    decode_rel = float((holistic[:, :40] - split[:, :40]).norm() / split[:, :40].norm())
    assert decode_rel < 1e-2, f"decode rows' relative difference {decode_rel:.2e}"


def test_holistic_replans_without_a_sync_and_matches_the_reference_on_fused_qkv_rows(monkeypatch):
    """Three batches on one backend (mixed, decode-only, mixed again), planned with torch.cuda.synchronize made to
    fail (the backend loaded the module, the wrapper's one synchronising plan, when it was built): each mixed batch
    equals the torch reference, q read from fused qkv rows, K/V written alike."""
    from bullet_ray.engine.attention.base import AttentionMetadata, get_backend_class

    torch.manual_seed(1)
    num_blocks = 64
    kv = torch.randn(1, num_blocks, 2, BS, 2, DIM, device="cuda", dtype=torch.bfloat16)
    fi = get_backend_class("flashinfer")(kv, 8, 2, DIM, DIM ** -0.5, mixed_attention="holistic")
    ref = get_backend_class("torch")(kv.clone(), 8, 2, DIM, DIM ** -0.5)
    batches = [([1, 1, 1, 20, 7], [33, 1, 70, 20, 90]), ([1, 1], [34, 71]), ([1, 1, 1, 30], [35, 72, 3, 130])]

    def no_sync(*_args, **_kwargs):
        raise AssertionError("a plan synchronised the device")

    for query_lens, seq_lens in batches:
        md = AttentionMetadata.contiguous(query_lens, seq_lens, BS, "cuda")
        qkv = torch.randn(sum(query_lens), (8 + 2 + 2) * DIM, device="cuda", dtype=torch.bfloat16)
        q, k, v = (t.view(-1, n, DIM) for t, n in zip(qkv.split([8 * DIM, 2 * DIM, 2 * DIM], dim=-1), (8, 2, 2)))
        with monkeypatch.context() as patch:  # the module was loaded (and synced) when the backend was built
            patch.setattr(torch.cuda, "synchronize", no_sync)
            fi.begin_batch(md)
            out = fi.forward(0, q, k, v, md).float()
        assert fi._holistic_planned == (max(query_lens) > 1)
        ref.begin_batch(md)
        expected = ref.forward(0, q.contiguous(), k.contiguous(), v.contiguous(), md).float()
        rel = float((out - expected).norm() / expected.norm())
        assert rel < 2e-2, f"{query_lens}: relative difference {rel:.4f}"
        assert torch.equal(fi.kv_cache, ref.kv_cache)


@pytest.mark.parametrize(("query_lens", "seq_lens", "ragged_from"), [
    ([1] * 24 + [150, 700, 300], [900 + 13 * i for i in range(24)] + [2200, 700, 300], 24 + 150),  # mixed, one continuing
    ([700, 300, 64], [700, 300, 64], 0),                                                         # fresh prompts only
    ([1] * 8 + [700, 150], [500] * 8 + [700, 2200], None),  # a fresh row before a continuing one: nothing ragged
])
def test_ragged_prefill_equals_paged_and_the_torch_reference(query_lens, seq_lens, ragged_from):
    """`prefill_attention: ragged` over four layers, q / K / V read in place from fused qkv rows: the fresh prompt rows
    through the ragged kernel over the step's own K/V give what the paged kernel gives over the pool (and what the
    torch reference gives), the decode rows and a chunk after a cached prefix through their paged kernels; the pool's
    K/V are written alike."""
    from bullet_ray.engine.attention.base import AttentionMetadata, get_backend_class

    torch.manual_seed(2)
    md = AttentionMetadata.contiguous(query_lens, seq_lens, BS, "cuda")
    num_blocks = sum((n + BS - 1) // BS for n in seq_lens)
    kv = torch.randn(LAYERS, num_blocks, 2, BS, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    qkv = torch.randn(LAYERS, md.num_tokens, (HEADS + 2 * KV_HEADS) * DIM, device="cuda", dtype=torch.bfloat16)
    split = [HEADS * DIM, KV_HEADS * DIM, KV_HEADS * DIM]
    outs = {}
    backends = {}
    for mode in ("paged", "ragged"):
        backend = get_backend_class("flashinfer")(kv.clone(), HEADS, KV_HEADS, DIM, DIM ** -0.5, prefill_attention=mode,
                                                   mixed_attention="split")
        with torch.inference_mode():
            backend.begin_batch(md)
            assert backend._ragged_from == (ragged_from if mode == "ragged" else None)
            layers = []
            for i in range(LAYERS):
                q, k, v = (t.view(md.num_tokens, -1, DIM) for t in qkv[i].split(split, dim=-1))
                layers.append(backend.forward(i, q, k, v, md))
            outs[mode] = torch.stack(layers).float()
        torch.cuda.synchronize()
        backends[mode] = backend
    rel = float((outs["ragged"] - outs["paged"]).norm() / outs["paged"].norm())
    assert rel < 1e-2, f"relative difference {rel:.2e}"
    assert torch.equal(backends["ragged"].kv_cache, backends["paged"].kv_cache)
    ref = get_backend_class("torch")(kv.clone(), HEADS, KV_HEADS, DIM, DIM ** -0.5)
    ref.begin_batch(md)
    q, k, v = (t.reshape(md.num_tokens, -1, DIM) for t in qkv[0].split(split, dim=-1))
    expected = ref.forward(0, q.contiguous(), k.contiguous(), v.contiguous(), md).float()
    rel_ref = float((outs["ragged"][0] - expected).norm() / expected.norm())
    assert rel_ref < 2e-2, f"against the torch reference: {rel_ref:.2e}"
    if ragged_from is not None:
        assert backends["ragged"]._direct[id(backends["ragged"].ragged)].direct_calls == LAYERS - 1
