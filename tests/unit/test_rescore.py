"""benchmarks.rescore: a saved sweep judged by other SLOs (attainment per rate, goodput per system)."""

from __future__ import annotations

import gzip
import json

from benchmarks.rescore import load_runs, markdown, rescore
from bullet_ray.bench.slo import parse_slo


def write_run_doc(path, doc, gz):
    """A run file as serve_h100 saves it: JSON, gzipped when `gz` (the name carries the suffix)."""
    if gz:
        with gzip.open(path, "wt") as f:
            json.dump(doc, f)
    else:
        path.write_text(json.dumps(doc))


def _write(folder, system, rate, requests, gz=False):
    doc = {"config": {"workload": {"rate_rps": rate}}, "requests": requests}
    write_run_doc(folder / f"{system}-rate{rate:g}.json{'.gz' if gz else ''}", doc, gz)


def _req(ttft_s, tpot_s, prompt_tokens=1000, success=True):
    return {"success": success, "ttft_s": ttft_s, "tpot_s": tpot_s, "prompt_tokens": prompt_tokens}


def test_attainment_and_goodput_under_absolute_and_per_token_targets(tmp_path):
    # rate 4: every request fast; rate 8: half miss strict's TTFT (0.5 s) but meet 1.5 ms/token x 1000 = 1.5 s
    _write(tmp_path, "a", 4, [_req(0.1, 0.01)] * 4, gz=True)
    _write(tmp_path, "a", 8, [_req(0.1, 0.01)] * 2 + [_req(1.2, 0.01)] * 2)
    _write(tmp_path, "b", 4, [_req(0.1, 0.01)] * 3 + [_req(0.1, 0.01, success=False)])
    (tmp_path / "notes.txt").write_text("ignored")
    runs = load_runs(tmp_path)
    assert set(runs) == {"a", "b"} and set(runs["a"]) == {4.0, 8.0}
    result = rescore(runs, ["strict", "bullet-azure-code"])
    assert result["a"]["attainment"]["strict"] == {"4.0": 1.0, "8.0": 0.5}
    assert result["a"]["attainment"]["bullet-azure-code"] == {"4.0": 1.0, "8.0": 1.0}
    g = result["a"]["goodput"]["strict"]
    assert g["measured_rps"] == 4.0 and g["is_bracketed"]
    assert abs(g["interpolated_rps"] - (4 + (1.0 - 0.9) / (1.0 - 0.5) * 4)) < 1e-9
    assert result["b"]["attainment"]["strict"] == {"4.0": 0.75}  # a failed request is a miss
    text = markdown(result, ["strict", "bullet-azure-code"])
    assert "| a | 4.80 | >= 8.00 |" in text and "| b | 0.00 |" in text


def test_misses_are_counted_by_why(tmp_path):
    # strict: TTFT <= 0.5 s, TPOT <= 25 ms; a TPOT of None (one output token) cannot miss TPOT
    _write(tmp_path, "a", 4, [_req(0.1, 0.01), _req(0.6, 0.01), _req(0.1, 0.03), _req(0.6, 0.03), _req(0.7, None),
                              _req(0.1, 0.01, success=False), _req(None, None)])
    result = rescore(load_runs(tmp_path), ["strict", "relaxed"])
    assert result["a"]["misses"]["strict"] == {"4.0": {"ttft": 2, "tpot": 1, "both": 1, "failed": 2}}
    assert result["a"]["misses"]["relaxed"] == {"4.0": {"ttft": 0, "tpot": 0, "both": 0, "failed": 2}}
    assert result["a"]["attainment"]["strict"] == {"4.0": round(1 / 7, 4)}
    assert "| a | strict | 4.0 | 7 | 2 | 1 | 1 | 2 |" in markdown(result, ["strict", "relaxed"])


def test_misses_are_exactly_what_the_slo_rejects_under_per_token_targets(tmp_path):
    # bullet-sharegpt: TTFT <= 3 ms x prompt tokens, TPOT <= 150 ms
    reqs = [_req(0.25, 0.01, prompt_tokens=100), _req(0.35, 0.01, prompt_tokens=100), _req(0.35, 0.2, prompt_tokens=100),
            _req(2.9, 0.2, prompt_tokens=1000), _req(0.1, 0.01, success=False)]
    _write(tmp_path, "a", 4, reqs)
    runs = load_runs(tmp_path)
    kinds = rescore(runs, ["bullet-sharegpt"])["a"]["misses"]["bullet-sharegpt"]["4.0"]
    assert kinds == {"ttft": 1, "tpot": 1, "both": 1, "failed": 1}
    slo = parse_slo("bullet-sharegpt")
    assert sum(kinds.values()) == sum(not slo.meets(r) for r in runs["a"][4.0])


def test_ttft_misses_give_their_ttft_range_and_prompts_against_the_met(tmp_path):
    # strict (TTFT <= 0.5 s): two long prompts late (1.8 s, one also slow on TPOT), two short ones met, a failure
    _write(tmp_path, "a", 4, [_req(1.8, 0.01, prompt_tokens=2000), _req(4.5, 0.03, prompt_tokens=3000),
                              _req(0.1, 0.01, prompt_tokens=900), _req(0.2, 0.01, prompt_tokens=1000),
                              _req(0.1, 0.01, success=False)])
    result = rescore(load_runs(tmp_path), ["strict", "relaxed"])
    assert result["a"]["ttft_misses"]["strict"]["4.0"] == {"count": 2, "ttft_s": [1.8, 4.5], "prompt_tokens_median": 2500,
                                                         "met_prompt_tokens_median": 950}
    assert result["a"]["ttft_misses"]["relaxed"]["4.0"]["count"] == 2
    text = markdown(result, ["strict", "relaxed"])
    assert "| a | strict | 4.0 | 2 | 1.80-4.50 | 2500 / 950 |" in text
    _write(tmp_path, "b", 4, [_req(0.1, 0.01)])
    assert rescore(load_runs(tmp_path), ["strict"])["b"]["ttft_misses"]["strict"]["4.0"] is None
