"""benchmarks.step_ab: decode step medians per (decode SMs, batch bucket) of two step logs, and their ratio."""

from __future__ import annotations

import gzip
import json

from benchmarks import step_ab


def _log(path, steps):
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"kind": "switch", "index": 0}) + "\n")
        for sms, seqs, ms, graphs in steps:
            f.write(json.dumps({"kind": "step", "side": "decode", "decode_sms": sms, "num_seqs": seqs,
                                "measured_ms": ms, "graphs": graphs}) + "\n")
        f.write(json.dumps({"kind": "step", "side": "prefill", "decode_sms": 16, "num_seqs": 1, "measured_ms": 99.0,
                            "graphs": "eager"}) + "\n")


def test_cells_pair_up_and_the_ratio_is_b_over_a(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.gz"
    _log(a, [(16, 5, 10.0, "decode")] * 3 + [(16, 20, 15.0, "decode")] * 3 + [(32, 40, 12.0, "decode")] * 3
         + [(16, 5, 50.0, "eager")] * 9)  # eager decode steps are not graph replays: left out
    _log(b, [(16, 9, 12.0, "decode")] * 3 + [(16, 17, 15.0, "decode")] * 3 + [(32, 40, 12.0, "decode")] * 2)
    out = tmp_path / "ab.json"
    assert step_ab.main([str(a), str(b), "--labels", "on,off", "--min-steps", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["decode_sms"], r["batch_from"], r["a_ms"], r["b_ms"], r["b_over_a"]) for r in rows] == [
        (16, 0, 10.0, 12.0, 1.2), (16, 16, 15.0, 15.0, 1.0)]  # (32, 32) has 2 steps in B: below --min-steps
    assert "median off/on over cells: 1.100" in capsys.readouterr().out
