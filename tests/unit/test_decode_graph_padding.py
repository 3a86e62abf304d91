"""Decode-graph padding rows read one KV slot each (the first slot of the first row's last page), not the
first row's whole context; real rows are unchanged. The GPU side (graph == eager, blocks outside the batch
untouched) is tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

from bullet_ray.engine.cuda_graphs import padded_rows


def test_padding_rows_see_one_token_of_the_first_rows_last_page():
    tables, lens = [[7, 3, 9], [4]], [40, 12]
    rows, padded_lens = padded_rows(tables, lens, 8)
    assert rows[:2] == tables and padded_lens[:2] == lens
    assert rows[2:] == [[9]] * 6 and padded_lens[2:] == [1] * 6
    assert sum(len(r) for r in rows) == 4 + 6  # the pages the kernel reads: 6 for the padding, not 6 x 3


def test_a_full_bucket_has_no_padding():
    tables, lens = [[1], [2, 5]], [3, 20]
    assert padded_rows(tables, lens, 2) == (tables, lens)
