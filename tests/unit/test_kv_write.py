"""The flashinfer backend's one-scatter K/V write (CPU-checkable parts): K and V split from one fused qkv
row are seen as one [tokens, 2, heads, dim] view, and scattering it to (K row, V row) pairs writes what two
index copies write; anything else is refused."""

from __future__ import annotations

import torch

from bullet_ray.engine.attention.flashinfer_backend import _adjacent_kv


def _split(tokens=5, heads=(4, 2, 2), dim=8):
    qkv = torch.randn(tokens, sum(heads) * dim)
    q, k, v = qkv.split([h * dim for h in heads], dim=-1)
    return qkv, q.view(tokens, heads[0], dim), k.view(tokens, heads[1], dim), v.view(tokens, heads[2], dim)


def test_kv_of_a_fused_row_is_one_view():
    qkv, _, k, v = _split()
    kv = _adjacent_kv(k, v)
    assert kv is not None and kv.shape == (5, 2, 2, 8)
    assert kv.data_ptr() == k.data_ptr()  # a view, no copy
    assert torch.equal(kv[:, 0], k) and torch.equal(kv[:, 1], v)


def test_scatter_equals_two_index_copies():
    _, _, k, v = _split()
    num_blocks, block = 4, 4
    slots = torch.tensor([0, 5, 6, 13, 15])
    k_rows = slots + torch.div(slots, block, rounding_mode="floor") * block
    rows_a = torch.zeros(num_blocks * 2 * block, 2, 8)
    rows_b = rows_a.clone()
    rows_a.index_put_((torch.stack((k_rows, k_rows + block), dim=1),), _adjacent_kv(k, v))
    rows_b.index_copy_(0, k_rows, k)
    rows_b.index_copy_(0, k_rows + block, v)
    assert torch.equal(rows_a, rows_b)


def test_other_layouts_are_refused():
    _, _, k, v = _split()
    assert _adjacent_kv(k.contiguous(), v) is None  # v is not right after this k
    assert _adjacent_kv(v, k) is None  # wrong order
    assert _adjacent_kv(k, v.contiguous()) is None
    _, _, k2, v2 = _split(heads=(4, 2, 1))
    assert _adjacent_kv(k2, v2) is None  # shapes differ
    assert _adjacent_kv(k.half(), v.half()) is None
    buf = torch.randn(2 * 2 * 8)
    k3, v3 = buf[:16].view(1, 2, 8), buf[16:].view(1, 2, 8)
    assert _adjacent_kv(k3, v3) is not None  # one storage: one view
    assert _adjacent_kv(k3.clone(), v3.clone()) is None  # separate allocations (the check is by storage)
