"""benchmarks.replay_online on a served step log: both variants predict every step, the size-keyed one
no worse than one factor per entry on the H100 conversation run's prefill steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import replay_online

LOG = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "serve_h100_m2c" / "bullet-slo-steps.jsonl.gz"


def test_replay_reports_both_variants(tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert replay_online.main([str(LOG), "--out", str(out)]) == 0
    result = json.loads(out.read_text())["logs"][str(LOG)]
    by_size, per_entry = result["by_size"], result["per_entry"]
    assert by_size["prefill"]["steps"] == per_entry["prefill"]["steps"] > 600
    assert by_size["decode"]["steps"] > 6000
    assert by_size["prefill"]["median"] < per_entry["prefill"]["median"]
    assert "[by_size]" in capsys.readouterr().out


def test_a_missing_log_is_a_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        replay_online.main([str(tmp_path / "nope.jsonl")])
    assert exc.value.code == 2
    assert "logs:" in capsys.readouterr().err
