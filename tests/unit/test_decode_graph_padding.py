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


def test_graph_buckets_reach_vllms_offline_batch_with_bounded_padding():
    """Serving configs (256 sequences) capture what they did; offline runs at 1,024 sequences get decode graphs
    for every batch size, each padded by at most 25% past 32 rows."""
    from bullet_ray.engine.cuda_graphs import graph_buckets

    assert graph_buckets(256)[-1] == 256 and len(graph_buckets(256)) == 19
    assert graph_buckets(300)[-1] == 320
    buckets = graph_buckets(1024)
    assert buckets[-1] == 1024
    for n in range(33, 1025):
        b = next(b for b in buckets if b >= n)
        assert (b - n) / n <= 0.25, (n, b)
    assert graph_buckets(5000)[-1] == 1024  # larger batches run through the piecewise graphs or eagerly


def test_piecewise_limit_holds_the_budget_on_one_partition():
    """By default a hybrid worker (one partition) graphs every step size of its budget; a bullet prefill side,
    which captures once per ladder entry, at most 2,048 tokens; a set value wins on both, capped by the budget."""
    from bullet_ray.config import EngineConfig

    offline = EngineConfig(model="dummy:tiny-llama", device="cpu", schedule="chunked", max_num_batched_tokens=16384)
    assert offline.piecewise_limit("hybrid") == 16384 and offline.piecewise_limit("prefill") == 2048
    small = EngineConfig(model="dummy:tiny-llama", device="cpu", max_num_batched_tokens=512)
    assert small.piecewise_limit("prefill") == 512
    set_ = EngineConfig(model="dummy:tiny-llama", device="cpu", max_num_batched_tokens=8192, piecewise_graph_tokens=4096)
    assert set_.piecewise_limit("hybrid") == 4096 == set_.piecewise_limit("prefill")
    assert EngineConfig(model="dummy:tiny-llama", device="cpu", piecewise_graph_tokens=0).piecewise_limit("hybrid") == 0


def test_plan_key_reuses_unsplit_tensor_core_plans_and_keys_the_rest_by_page_counts():
    from bullet_ray.engine.cuda_graphs import plan_key

    unsplit = {"disable_split_kv": True}
    # tensor cores without a split: one work item a row whatever its length, the same plan every step
    assert plan_key(unsplit, [1, 2, 3], True) == plan_key(unsplit, [7, 9, 40], True)
    # a split (balanced or flashinfer's own), or the CUDA-core kernel (which ignores disable_split_kv): page counts
    split = {"fixed_split_size": 4}
    assert plan_key(split, [1, 2, 3], True) == plan_key(split, [1, 2, 3], True)
    assert plan_key(split, [1, 2, 3], True) != plan_key(split, [1, 2, 4], True)
    assert plan_key({}, [1, 2], True) != plan_key({}, [1, 3], True)
    assert plan_key(unsplit, [1, 2], False) != plan_key(unsplit, [1, 3], False)
    assert plan_key(unsplit, [1, 2], True) != plan_key(split, [1, 2], True)  # the options are part of it
    # a tensor-core wrapper off fa2 (fa3's plan reads the lengths in tokens): never reused
    assert plan_key(unsplit, [1, 2], True, "fa3") is None and plan_key(unsplit, [1, 2], True, "auto") is None
    assert plan_key(unsplit, [1, 2], False, "auto") is not None  # the CUDA-core kernel: keyed by page counts


def test_meta_layout_puts_each_table_on_an_aligned_offset_without_overlap():
    import torch

    from bullet_ray.engine.cuda_graphs import MetaLayout

    layout = MetaLayout(256, 256 * 33)
    buf = torch.arange(layout.size, dtype=torch.int32)
    indptr, last, indices = layout.views(buf)
    assert (indptr.numel(), last.numel(), indices.numel()) == (257, 256, 256 * 33)
    starts = [int(v[0]) for v in (indptr, last, indices)]
    assert all(s % MetaLayout.ALIGN == 0 for s in starts)
    assert starts[0] + 257 <= starts[1] and starts[1] + 256 <= starts[2] and starts[2] + 256 * 33 == layout.size
