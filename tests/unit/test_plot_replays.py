"""benchmarks/plot_replays on synthetic replay_split results: grouping, the table, the figure, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.plot_replays import goodput_table, load, main, points_of, table


def _result(folder: Path, name: str, run: str, order: str, replayed: float, measured: float) -> None:
    (folder / name).write_text(json.dumps({"run": run, "prefill_order": order, "measured": {"attainment": measured},
                                           "rows": [{"attainment": {"mean": replayed, "min": replayed, "max": replayed}}]}))


def test_points_grouped_by_served_run_rate_and_setting(tmp_path: Path, capsys) -> None:
    run = "benchmarks/results/serve_x/seed3/runs/bullet-slo-rate{}.json.gz"
    for rate, ls, mot in ((24, 0.95, 0.97), (32, 0.87, 0.91)):
        _result(tmp_path, f"a{rate}_ls.json", run.format(rate), "least_slack", ls, 0.9)
        _result(tmp_path, f"a{rate}_mot.json", run.format(rate), "max_on_time", mot, 0.9)
    points = points_of(load(tmp_path))
    assert points == {"serve_x/seed3": {"measured": {24.0: 0.9, 32.0: 0.9}, "least_slack": {24.0: 0.95, 32.0: 0.87},
                                        "max_on_time": {24.0: 0.97, 32.0: 0.91}}}
    assert "| serve_x/seed3 | 32 | 90.0% | 87.0% | 91.0% |" in table(points)
    assert main([str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0 and "max_on_time" in capsys.readouterr().out


def test_bad_input_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no replay_split JSON"):
        main([str(tmp_path)])
    (tmp_path / "x.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="x.json: not a replay_split result"):
        main([str(tmp_path)])
    with pytest.raises(SystemExit, match="is not a folder"):
        main([str(tmp_path / "none")])


def test_the_figure_names_the_slo_the_replays_were_scored_under(tmp_path: Path) -> None:
    from benchmarks.plot_replays import load

    run = "benchmarks/results/serve_x/seed4/runs/bullet-slo-relaxed-rate40.json.gz"
    _result(tmp_path, "a.json", run, "least_slack", 0.9, 0.9)
    assert load(tmp_path)[0].slo == "strict"  # results written before replay_split had --slo
    doc = json.loads((tmp_path / "a.json").read_text())
    (tmp_path / "a.json").write_text(json.dumps({**doc, "slo": "relaxed"}))
    assert load(tmp_path)[0].slo == "relaxed"
    _result(tmp_path, "b.json", run.replace("rate40", "rate48"), "least_slack", 0.8, 0.8)  # no slo: strict
    with pytest.raises(SystemExit, match="different SLOs"):
        main([str(tmp_path)])


def test_goodput_over_the_replayed_rates_interpolated_bounded_or_below():
    """Goodput per served run and setting: where attainment crosses 90% between the replayed rates (24: 95%, 32: 87%
    -> 24 + 8 x 5/8 = 29.00), ">= top" when the top rate still meets it, "< lowest" when the lowest does not."""
    points = {"serve_x/seed3": {"measured": {24.0: 0.95, 32.0: 0.87}, "least_slack": {24.0: 0.85, 32.0: 0.80},
                                "max_on_time": {24.0: 0.97, 32.0: 0.91}}}
    text = goodput_table(points, "relaxed")
    assert "relaxed SLO" in text and "| serve_x/seed3 | 29.00 | < 24 | >= 32 |" in text


def test_an_empty_split_rule_is_named_default(tmp_path: Path) -> None:
    """`replay_split --split-rule '{}'` replays the engine's own rule: the table and legend call it "default"."""
    run = "benchmarks/results/serve_x/seed9/runs/bullet-slo-rate48.json.gz"
    for name, rule, att in (("a.json", {}, 0.69), ("b.json", {"balance": "tpot_first"}, 0.78)):
        (tmp_path / name).write_text(json.dumps({"run": run, "split_rule": rule, "measured": {"attainment": 0.48},
                                                 "rows": [{"attainment": {"mean": att, "min": att, "max": att}}]}))
    settings = {r.setting: r.replayed for r in load(tmp_path, label_by="split_rule")}
    assert settings == {"default": 0.69, "{'balance': 'tpot_first'}": 0.78}
