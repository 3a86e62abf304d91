"""benchmarks/replay_vs_served on synthetic replay_split results: pairing a replayed setting with the served run
that had it, the predicted and measured changes, the report's counts, the figure, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.replay_vs_served import load, main, pair_up, parse_systems, report

SYSTEMS = "least_slack=bullet-a,max_on_time=bullet-a-mot"


def _result(folder: Path, system: str, rate: int, order: str, replayed: float, measured: float,
            slo: str | None = None, name: str | None = None) -> None:
    run = f"benchmarks/results/serve_x/seed4/runs/{system}-rate{rate}.json.gz"
    doc = {"run": run, "prefill_order": order, "measured": {"attainment": measured},
           "rows": [{"attainment": {"mean": replayed, "min": replayed - 0.02, "max": replayed + 0.02}}]}
    (folder / (name or f"{system}_{rate}_{order}.json")).write_text(json.dumps(doc if slo is None else {**doc, "slo": slo}))


def _ab(folder: Path) -> None:
    # served at 40 req/s: least_slack 60%, max_on_time 90%; each run replayed with both orders
    _result(folder, "bullet-a", 40, "least_slack", 0.80, 0.60)
    _result(folder, "bullet-a", 40, "max_on_time", 0.88, 0.60)
    _result(folder, "bullet-a-mot", 40, "least_slack", 0.85, 0.90)
    _result(folder, "bullet-a-mot", 40, "max_on_time", 0.91, 0.90)


def test_each_replayed_setting_meets_the_served_run_that_had_it(tmp_path: Path) -> None:
    _ab(tmp_path)
    pairs = pair_up(load(tmp_path), parse_systems(SYSTEMS))
    assert len(pairs) == 4
    cross = {(p.source, p.setting): p for p in pairs if p.source != p.setting}
    ls_to_mot = cross["least_slack", "max_on_time"]
    # replayed from the least_slack run with max_on_time: 88%, against max_on_time's served 90%
    assert (ls_to_mot.replayed, ls_to_mot.measured) == (0.88, 0.90)
    assert ls_to_mot.predicted_change == pytest.approx(0.08) and ls_to_mot.measured_change == pytest.approx(0.30)
    mot_to_ls = cross["max_on_time", "least_slack"]
    assert mot_to_ls.predicted_change == pytest.approx(-0.06) and mot_to_ls.measured_change == pytest.approx(-0.30)
    text = report(pairs)
    assert "| serve_x/seed4 | 40 | least_slack | max_on_time | 88.0% [86.0%, 90.0%] | 90.0% | +8.0 | +30.0 |" in text
    # each run with its own order: 80% replayed against 60% served (outside [78, 82]), 91% against 90% (inside)
    assert "replayed with its own setting: 2 runs" in text and "inside the replay's [min, max] over seeds: 1 of 2" in text
    assert text.startswith("strict SLO attainment")  # results without --slo were scored under strict
    assert "least_slack -> max_on_time (1 served differences, each predicted from the least_slack run): the predicted " \
           "change has the measured one's sign in 1 of 1" in text
    assert "mean change predicted +8.0, measured +30.0 points" in text
    assert "|replayed - measured| median 10.5 points, max 20.0" in text  # own setting: 20 and 1 points off


def test_a_change_under_half_a_point_has_no_sign(tmp_path: Path) -> None:
    _result(tmp_path, "bullet-a", 24, "least_slack", 0.95, 0.96)
    _result(tmp_path, "bullet-a", 24, "max_on_time", 0.953, 0.96)  # +0.3 points predicted
    _result(tmp_path, "bullet-a-mot", 24, "least_slack", 0.95, 0.96)
    _result(tmp_path, "bullet-a-mot", 24, "max_on_time", 0.95, 0.96)
    assert "sign in 0 of 0" in report(pair_up(load(tmp_path), parse_systems(SYSTEMS)))


def test_main_prints_and_draws(tmp_path: Path, capsys) -> None:
    _ab(tmp_path)
    assert main([str(tmp_path), "--systems", SYSTEMS, "--out", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 0 and "change predicted" in capsys.readouterr().out


def test_bad_input_is_a_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no replay_split JSON"):
        main([str(tmp_path), "--systems", SYSTEMS])
    with pytest.raises(SystemExit, match="is not setting=system"):
        parse_systems("least_slack")
    with pytest.raises(SystemExit, match="at least two settings"):
        parse_systems("least_slack=a")
    with pytest.raises(SystemExit, match="named for two settings"):
        parse_systems("least_slack=a,max_on_time=a")
    with pytest.raises(SystemExit, match="named twice"):
        parse_systems("least_slack=a,least_slack=b")
    _result(tmp_path, "bullet-a", 40, "least_slack", 0.8, 0.6)
    _result(tmp_path, "bullet-a", 40, "max_on_time", 0.88, 0.6)
    with pytest.raises(SystemExit, match="no replay of bullet-a-mot's run"):
        main([str(tmp_path), "--systems", SYSTEMS])
    (tmp_path / "x.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit, match="x.json: not a replay_split result"):
        main([str(tmp_path), "--systems", SYSTEMS])


def test_mixed_slos_duplicates_and_run_paths_outside_runs_are_refused(tmp_path: Path) -> None:
    _ab(tmp_path)
    _result(tmp_path, "bullet-a", 32, "least_slack", 0.9, 0.9, slo="relaxed")
    with pytest.raises(SystemExit, match="different SLOs"):
        load(tmp_path)
    (tmp_path / "bullet-a_32_least_slack.json").unlink()
    _result(tmp_path, "bullet-a", 40, "least_slack", 0.8, 0.6, name="again.json")
    with pytest.raises(SystemExit, match="replay the same run with the same prefill_order"):
        load(tmp_path)
    (tmp_path / "again.json").unlink()
    doc = json.loads((tmp_path / "bullet-a_40_least_slack.json").read_text())
    (tmp_path / "bullet-a_40_least_slack.json").write_text(json.dumps({**doc, "run": "x/bullet-a-rate40.json"}))
    with pytest.raises(SystemExit, match="<draw>/runs/"):
        load(tmp_path)
