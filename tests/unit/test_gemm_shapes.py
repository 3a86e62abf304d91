"""benchmarks.gpu.gemm_shapes: the token ranges it reads and the padding choice it reports."""

from __future__ import annotations

import json

import pytest

from benchmarks.gpu.gemm_shapes import main, pad_choices, parse_range


def test_parse_range_and_lists() -> None:
    assert parse_range("64:192:64") == [64, 128, 192]
    assert parse_range("96,32,96") == [32, 96]
    for bad in ("0:10:1", "10:5:1", "1:5:0", "-3", ""):
        with pytest.raises(SystemExit):
            parse_range(bad)


def test_pad_choice_is_the_fastest_count_within_the_window() -> None:
    times = {2048: 10.0, 2080: 11.0, 2112: 10.5, 2176: 10.2, 2400: 9.0}
    pads = pad_choices(times, window=128)
    assert pads[2048] == (2048, 0.0)  # nothing faster above it within 128 rows
    assert pads[2080][0] == 2176 and pads[2080][1] == pytest.approx(0.8 / 11.0)
    assert pads[2112] == (2176, pytest.approx(0.3 / 10.5))
    assert pads[2400] == (2400, 0.0)


@pytest.mark.slow
def test_cpu_smoke_writes_every_row(tmp_path) -> None:
    assert main(["--device", "cpu", "--model", "dummy:tiny-llama", "--tokens", "8,16", "--reps", "1",
                 "--warmup", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gemm_shapes.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [8, 16] and all(r["step_ms"] > 0 and r["pad_to"] in (8, 16) for r in rows)
