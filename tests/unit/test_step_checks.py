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


def test_engine_correctness_runs_the_chunked_check_per_family(tmp_path, monkeypatch):
    """`engine_correctness --chunked-check` (CPU smoke: both sides eager) adds the chunked schedule's graph-vs-eager
    check to each family's result, with only the prompt lengths the model's context holds."""
    import json

    from benchmarks.gpu import engine_correctness
    from benchmarks.gpu.step_checks import CHUNKED_CHECK_LENGTHS

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(engine_correctness, "FAMILIES", ["tiny-llama"])
    assert engine_correctness.main(["--device", "cpu", "--backend", "torch", "--chunked-check", "--name", "smoke"]) == 0
    result = json.loads((tmp_path / "smoke.json").read_text())["families"]["tiny-llama"]["chunked_graphs_vs_eager"]
    assert result["tokens_equal"] and result["first_divergence"] == [None] * len(result["prompt_lengths"])
    # the tiny Llama holds 1,024 positions: the 1,200- and 2,000-token prompts (plus 48 new tokens) are left out
    assert result["prompt_lengths"] == [n for n in CHUNKED_CHECK_LENGTHS if n + 48 <= 1024] == [40, 300, 77, 650, 15, 900]
