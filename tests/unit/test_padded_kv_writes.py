"""Without a scratch slot a decode graph's padding rows write row 0's slot (cuda_graphs.padded_rows); from the second layer on their
K/V differ from row 0's, so row 0's must be the write that stays (`store_first_row_last`)."""

from __future__ import annotations

import torch

from bullet_ray.engine.attention.flashinfer_backend import FlashInferBackend, store_first_row_last
from bullet_ray.engine.cuda_graphs import padded_rows


def _kv(values: list[float]) -> torch.Tensor:
    """[tokens, 2, 1, 2]: token i's K row all values[i], its V row all -values[i]."""
    t = torch.tensor(values).view(-1, 1, 1, 1)
    return torch.cat((t, -t), dim=1).expand(-1, 2, 1, 2).contiguous()


def test_row_0_keeps_its_slot_against_the_padding_rows():
    rows = torch.zeros(8, 1, 2)
    # row 0 -> rows (0, 1), row 1 -> (2, 3), two padding rows repeating row 0's slot
    kv_rows = torch.tensor([[0, 1], [2, 3], [0, 1], [0, 1]])
    kv = _kv([1.0, 2.0, 7.0, 7.0])  # the padding rows' K/V differ from row 0's
    store_first_row_last(rows, kv_rows, kv)
    assert rows[0].eq(1.0).all() and rows[1].eq(-1.0).all()  # row 0's K and V
    assert rows[2].eq(2.0).all() and rows[3].eq(-2.0).all()
    assert rows[4:].eq(0).all()  # nothing else written


def test_one_scatter_can_keep_a_padding_rows_kv():
    """What the ordered write avoids: on the CPU one `index_put_` keeps the last duplicate (a padding row);
    on the GPU which one stays is undefined."""
    rows = torch.zeros(4, 1, 2)
    rows.index_put_((torch.tensor([[0, 1], [0, 1]]),), _kv([1.0, 7.0]))
    assert rows[0].eq(7.0).all()


def test_write_kv_orders_only_while_a_graph_is_captured():
    """The backend's write path: the flag (set by DecodeGraphs around a capture of more than one row) makes
    row 0's K/V stay, from adjacent (fused qkv) views and from separate k / v; off, as before."""
    backend = object.__new__(FlashInferBackend)  # no flashinfer needed for the write path
    backend.kv_cache = torch.zeros(1, 2, 2, 4, 1, 2)  # [layers, blocks, K/V, block_size, kv_heads, head_dim]
    backend._rows_md, backend._kv_rows = None, None
    backend.bind_layer_views()
    md = type("Md", (), {})()
    md.slot_mapping = torch.tensor([1, 5, 1, 1])  # row 0 at slot 1, row 1 at slot 5, two padding rows
    k = torch.tensor([1.0, 2.0, 7.0, 7.0]).view(4, 1, 1).expand(4, 1, 2).contiguous()
    qkv = torch.cat((k, -k), dim=-1).view(4, 4)  # k and v adjacent in one row, as the model passes them
    fused_k, fused_v = qkv[:, :2].view(4, 1, 2), qkv[:, 2:].view(4, 1, 2)
    for k_in, v_in in ((fused_k, fused_v), (k, -k)):
        backend.kv_cache.zero_()
        backend.forget_batch()
        backend.first_row_writes_last = True
        backend.write_kv(0, k_in, v_in, md)
        cache = backend.kv_cache[0]
        assert cache[0, 0, 1].eq(1.0).all() and cache[0, 1, 1].eq(-1.0).all()  # slot 1: row 0's K, V
        assert cache[1, 0, 1].eq(2.0).all() and cache[1, 1, 1].eq(-2.0).all()  # slot 5: row 1's
    backend.first_row_writes_last = False
    assert FlashInferBackend.first_row_writes_last is False


def test_padding_rows_see_one_token_of_row_0():
    tables, lens = padded_rows([[3, 4, 9], [5]], [40, 2], 4)
    assert tables == [[3, 4, 9], [5], [9], [9]] and lens == [40, 2, 1, 1]
