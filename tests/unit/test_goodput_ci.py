"""benchmarks.goodput_ci: bootstrap intervals for goodput and goodput ratios on small synthetic sweeps."""

from __future__ import annotations

import json

import pytest

from benchmarks.goodput_ci import build_parser, main, run
from bullet_ray.bench.result import RequestRecord
from bullet_ray.bench.slo import PRESETS, attainment, goodput
from tests.unit.test_rescore import write_run_doc

RATES = (8, 16, 24, 32)


def _request(i, is_met):
    """A finished request of 11 tokens: meets strict (TTFT 0.1 s, TPOT 10 ms) or misses its TTFT (2 s)."""
    ttft = 0.1 if is_met else 2.0
    return RequestRecord(index=i, scheduled_s=0.0, prompt_tokens_requested=100, output_tokens_requested=11,
                         send_s=0.0, ttft_s=ttft, itl_s=[0.01] * 10, e2e_s=ttft + 0.1, prompt_tokens=100,
                         output_tokens=11)


def _write_sweep(folder, system, attainments, num_requests=150, gz=True):
    """runs/<system>-rate<R>.json[.gz] with the given share of requests meeting strict at each of RATES."""
    runs = folder / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    for rate, share in zip(RATES, attainments):
        num_met = round(share * num_requests)
        records = [_request(i, i < num_met) for i in range(num_requests)]
        doc = {"config": {"label": system, "workload": {"rate_rps": float(rate)}}, "summary": {},
               "requests": [r.to_dict() for r in records]}
        write_run_doc(runs / f"{system}-rate{rate}.json{'.gz' if gz else ''}", doc, gz)


def _run(folder, *extra):
    return run(build_parser().parse_args([str(folder), "--no-progress", "--resamples", "400", *extra]), "test")


def _pair(doc, a, b, slo="strict"):
    return next(p for p in doc["pairs"] if (p["a"], p["b"], p["slo"]) == (a, b, slo))


def test_point_estimate_is_the_projects_goodput(tmp_path):
    shares = (1.0, 0.96, 0.84, 0.5)
    _write_sweep(tmp_path, "a", shares, gz=False)
    records = {r: [_request(i, i < round(s * 150)) for i in range(150)] for r, s in zip(RATES, shares)}
    expected = goodput([(r, attainment(records[r], PRESETS["strict"])) for r in RATES], "strict")
    doc = _run(tmp_path, "--slo", "strict,relaxed")
    point = doc["systems"]["a"]["strict"]["point"]
    assert point["goodput"] == expected.to_dict()
    assert point["value"] == expected.interpolated_rps and point["censored"] is None
    assert point["label"] == f"{expected.interpolated_rps:.2f}"
    s = doc["systems"]["a"]["strict"]
    assert s["p2.5"]["value"] <= s["p50"]["value"] <= s["p97.5"]["value"]
    assert s["p2.5"]["value"] < expected.interpolated_rps < s["p97.5"]["value"]
    assert doc["systems"]["a"]["relaxed"]["point"]["goodput"]["interpolated_rps"] == expected.interpolated_rps
    assert doc["compare_json_check"] is None  # no compare.json in the folder


def test_never_missed_and_never_met_are_censored(tmp_path):
    _write_sweep(tmp_path, "always", (1.0, 1.0, 1.0, 1.0))
    _write_sweep(tmp_path, "never", (0.5, 0.3, 0.1, 0.0))
    _write_sweep(tmp_path, "mid", (1.0, 0.95, 0.8, 0.5))
    doc = _run(tmp_path)
    always, never = doc["systems"]["always"]["strict"], doc["systems"]["never"]["strict"]
    assert always["point"]["censored"] == "above" and always["point"]["label"] == ">= 32.00"
    assert always["p2.5"]["label"] == ">= 32.00" and always["share_censored_above"] == 1.0
    assert never["point"]["censored"] == "below" and never["point"]["label"] == "< 8.00"
    assert never["share_never_met"] == 1.0
    # >= 32 against a bracketed goodput below 32: certainly >= 1; both >= 32: left open
    assert _pair(doc, "always", "mid")["p_ratio_ge"]["1"]["p_min"] == 1.0
    both = _pair(doc, "always", "never")
    assert both["point"] == "inf" and both["share_censored"] == 1.0
    assert _pair(doc, "mid", "never")["p_ratio_ge"]["1"]["p_min"] == 1.0
    _write_sweep(tmp_path, "always2", (1.0, 1.0, 1.0, 1.0))
    open_pair = _pair(_run(tmp_path, "--pairs", "always/always2"), "always", "always2")
    assert open_pair["p_ratio_ge"]["1"]["p_min"] == 0.0 and open_pair["p_ratio_ge"]["1"]["p_max"] == 1.0


def test_identical_systems_ratio_straddles_one(tmp_path):
    shares = (1.0, 0.95, 0.85, 0.5)
    _write_sweep(tmp_path, "a", shares)
    _write_sweep(tmp_path, "b", shares)
    p = _pair(_run(tmp_path, "--resamples", "1000"), "a", "b")
    assert p["point"] == 1.0
    assert p["p2.5"] < 1.0 < p["p97.5"]
    assert 0.4 < p["p_ratio_ge"]["1"]["p"] < 0.6  # ties (equal resampled goodputs) count as >= 1


def test_clearly_better_system_and_goal(tmp_path):
    _write_sweep(tmp_path, "fast", (1.0, 1.0, 0.95, 0.6))
    _write_sweep(tmp_path, "slow", (0.97, 0.6, 0.2, 0.0))
    doc = _run(tmp_path, "--goal", "1.25,1.1", "--pairs", "fast/slow,slow/fast")
    assert list(_pair(doc, "fast", "slow")["p_ratio_ge"]) == ["1", "1.25", "1.1"]
    assert _pair(doc, "fast", "slow")["p_ratio_ge"]["1"]["p"] == 1.0
    assert _pair(doc, "fast", "slow")["p_ratio_ge"]["1.25"]["p"] > 0.99
    assert _pair(doc, "slow", "fast")["p_ratio_ge"]["1"]["p"] == 0.0


def test_seeded_and_independent_of_the_other_systems(tmp_path):
    _write_sweep(tmp_path, "a", (1.0, 0.95, 0.85, 0.5))
    _write_sweep(tmp_path, "b", (1.0, 0.9, 0.7, 0.5))
    both = _run(tmp_path, "--seed", "3")
    only_a = _run(tmp_path, "--seed", "3", "--systems", "a")
    assert both["systems"]["a"] == only_a["systems"]["a"] and only_a["pairs"] == []
    assert _run(tmp_path, "--seed", "4")["pairs"] != both["pairs"]


def test_cli_writes_table_json_and_checks_compare_json(tmp_path, capsys):
    _write_sweep(tmp_path, "a", (1.0, 0.95, 0.85, 0.5))
    _write_sweep(tmp_path, "b", (1.0, 0.9, 0.7, 0.5))
    points = [(r, round(s * 150) / 150) for r, s in zip(RATES, (1.0, 0.95, 0.85, 0.5))]  # what _write_sweep sent
    good = {"a": {"goodput": {"strict": goodput(points, "strict").to_dict()}}}
    (tmp_path / "compare.json").write_text(json.dumps({"systems": good}))
    out = tmp_path / "ci" / "goodput_ci.json"
    assert main([str(tmp_path), "--slo", "strict", "--resamples", "200", "--no-progress", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m benchmarks.goodput_ci") and doc["date"]
    assert [r["rate_rps"] for r in doc["inputs"]["runs"] if r["system"] == "a"] == [8.0, 16.0, 24.0, 32.0]
    assert doc["compare_json_check"] == {"file": str(tmp_path / "compare.json"), "num_checked": 1, "mismatches": []}
    text = (tmp_path / "ci" / "goodput_ci.txt").read_text()
    assert "| a / b | strict |" in text and "all equal." in text and text.split("\n\n", 1)[1] in capsys.readouterr().out
    good["a"]["goodput"]["strict"]["interpolated_rps"] = 99.0
    (tmp_path / "compare.json").write_text(json.dumps({"systems": good}))
    assert main([str(tmp_path), "--slo", "strict", "--resamples", "20", "--no-progress"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "field"), [
    (["{missing}"], "DIR:"),
    (["{empty}"], "DIR: no run files"),
    (["{tmp}", "--systems", "a,zzz"], "--systems: unknown system 'zzz'"),
    (["{tmp}", "--pairs", "a/zzz"], "--pairs: unknown system 'zzz'"),
    (["{tmp}", "--pairs", "a-b"], "--pairs:"),
    (["{tmp}", "--slo", "nope"], "--slo:"),
    (["{tmp}", "--resamples", "0"], "--resamples:"),
    (["{tmp}", "--seed", "-1"], "--seed:"),
    (["{tmp}", "--goal", "1.2,x"], "--goal:"),
    (["{bad}"], "broken-rate8.json: requests[0]: missing index"),
    (["{corrupt}"], "broken-rate8.json: cannot read"),
])
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, args, field):
    _write_sweep(tmp_path, "a", (1.0, 0.9, 0.8, 0.5))
    (tmp_path / "empty").mkdir()
    for name, text in (("bad", json.dumps({"requests": [{"ttft_s": 0.1}]})), ("corrupt", "{not json")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "broken-rate8.json").write_text(text)
    paths = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "tmp": tmp_path,
             "bad": tmp_path / "bad", "corrupt": tmp_path / "corrupt"}
    assert main([a.format(**paths) for a in args] + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err and err.count("\n") == 1 and "Traceback" not in err


def test_serve_h100_writes_intervals_beside_its_comparison(tmp_path):
    """After a sweep (or a merge whose folder has runs/), serve_h100 leaves goodput_ci.{json,txt} beside
    compare.md; a folder without run files gets none."""
    from benchmarks.gpu.serve_h100 import write_intervals

    write_intervals(tmp_path, ["strict"])
    assert not (tmp_path / "goodput_ci.json").exists()
    _write_sweep(tmp_path, "a", [1.0, 1.0, 0.95, 0.5])
    _write_sweep(tmp_path, "b", [1.0, 0.5, 0.2, 0.1])
    write_intervals(tmp_path, ["strict"])
    doc = json.loads((tmp_path / "goodput_ci.json").read_text())
    assert [(p["a"], p["b"], p["slo"]) for p in doc["pairs"]] == [("a", "b", "strict")]
    assert doc["goals"] == [1.2, 1.25] and "a / b" in (tmp_path / "goodput_ci.txt").read_text()
