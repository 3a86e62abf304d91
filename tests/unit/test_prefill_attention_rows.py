"""`prefill_attention: ragged` (the default): which prompt rows of a batch run ragged over the step's own K/V
(`split_fresh_rows`: those after the last row with a cached prefix), and the validation of the GPU attention's two
switches (`BULLET_RAY_PREFILL_ATTENTION`, `BULLET_RAY_KV_WRITE`). The kernels
themselves are compared on the GPU (tests/gpu/test_mixed_attention_gpu.py)."""

from __future__ import annotations

import pytest

from bullet_ray.engine.attention.flashinfer_backend import (
    default_kv_write,
    default_prefill_attention,
    split_fresh_rows,
)


@pytest.mark.parametrize(("query_lens", "seq_lens", "paged"), [
    ([700, 150], [700, 150], 0),            # every row starts its prompt: all ragged
    ([150, 700], [2200, 700], 1),           # a chunk after a cached prefix first (the chunked schedule's order)
    ([700, 150, 30], [700, 2200, 30], 2),   # a fresh row before a continuing one stays paged (one range each)
    ([64], [64 + 16], 1),                   # the only row continues: nothing ragged
    ([], [], 0),
])
def test_rows_up_to_the_last_cached_prefix_stay_paged(query_lens, seq_lens, paged):
    assert split_fresh_rows(query_lens, seq_lens) == paged


@pytest.mark.parametrize(("variable", "default", "default_value", "other"), [
    ("BULLET_RAY_PREFILL_ATTENTION", default_prefill_attention, "ragged", "paged"),
    ("BULLET_RAY_KV_WRITE", default_kv_write, "append", "scatter"),
])
def test_engine_switches_default_and_their_errors(monkeypatch, variable, default, default_value, other):
    monkeypatch.delenv(variable, raising=False)
    assert default() == default_value
    monkeypatch.setenv(variable, other)
    assert default() == other
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(ValueError, match=variable):
        default()
