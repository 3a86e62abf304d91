"""benchmarks.gpu.step_checks' graph-vs-eager token check, run as its CPU smoke (both sides eager there)."""

import torch

from benchmarks.gpu.step_checks import chunked_graphs_vs_eager
from bullet_ray.models.loader import load_model


def test_chunked_check_reports_equal_rows_and_no_divergence_on_cpu():
    loaded = load_model("dummy:tiny-llama", dtype=torch.float32, device="cpu")
    r = chunked_graphs_vs_eager(loaded.model, loaded.config, num_new=4, device="cpu", lengths=[5, 9, 30])
    assert r["tokens_equal"] and r["rows_equal"] == [True, True, True]
    assert r["first_divergence"] == [None, None, None] and r["token_agreement"] == 1.0
    assert r["graph"]["steps"] == r["eager"]["steps"] == 4
    # every row's closest call is a margin (top-1 minus top-2 logprob, >= 0); none parted, so no parting margins
    assert all(m is not None and m >= 0 for m in r["least_margin_eager"])
    assert r["margin_at_divergence"] == [None, None, None]
