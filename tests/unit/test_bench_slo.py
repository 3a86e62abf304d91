"""SLO attainment, goodput and the run summary on a recorded run with known answers."""

from __future__ import annotations

import pytest

from bullet_ray.bench.serve_bench import RequestRecord
from bullet_ray.bench.slo import PRESETS, SLO, attainment, goodput, parse_slo, summarize


def _rec(ttft_s, num_out, tpot_s, prompt=100, error=None, itl=()):
    """A finished request: e2e = ttft + tpot * (num_out - 1)."""
    e2e = None if ttft_s is None else ttft_s + tpot_s * (num_out - 1)
    return RequestRecord(index=0, scheduled_s=0.0, prompt_tokens_requested=prompt, output_tokens_requested=num_out,
                         send_s=0.0, ttft_s=ttft_s, itl_s=list(itl), e2e_s=e2e, prompt_tokens=prompt,
                         output_tokens=num_out, error=error)


# ttft (s), outputs, tpot (s), prompt tokens
RUN = [
    _rec(0.25, 11, 0.020, prompt=100, itl=[0.01, 0.03]),  # A: relaxed yes, strict yes, sharegpt (0.3 s) yes
    _rec(0.75, 11, 0.040, prompt=400),  # B: relaxed yes, strict no (ttft), sharegpt (1.2 s) yes
    _rec(1.5, 5, 0.010, prompt=1000),  # C: relaxed no (ttft), strict no, sharegpt (3 s) yes
    _rec(0.125, 1, 0.0, prompt=10),  # D: one token, no TPOT: relaxed yes, strict yes, sharegpt (30 ms) no
    _rec(None, 8, 0.0, prompt=50, error="HTTP 500: boom"),  # E: failed, a miss everywhere
    _rec(0.375, 6, 0.0625, prompt=200, itl=[0.05]),  # F: tpot 62.5 ms: relaxed no, strict no, sharegpt yes
]


def test_tpot_and_success():
    assert [r.success for r in RUN] == [True, True, True, True, False, True]
    assert RUN[0].tpot_s == pytest.approx(0.020) and RUN[3].tpot_s is None and RUN[4].tpot_s is None


def test_attainment_known_answers():
    assert attainment(RUN, PRESETS["relaxed"]) == 3 / 6  # A, B, D
    assert attainment(RUN, PRESETS["strict"]) == 2 / 6  # A, D
    assert attainment(RUN, PRESETS["bullet-sharegpt"]) == 4 / 6  # A, B, C, F
    assert attainment([], PRESETS["relaxed"]) == 0.0


def test_per_token_ttft_target():
    slo = PRESETS["bullet-azure-code"]
    assert slo.ttft_target_s(1000) == pytest.approx(1.5) and slo.tpot_s == 0.2
    assert "1.5 ms x prompt tokens" in slo.describe()


def test_parse_slo():
    assert parse_slo("strict") is PRESETS["strict"]
    custom = parse_slo("ttft_ms=800,tpot_ms=40,name=mine")
    assert custom == SLO("mine", tpot_s=0.04, ttft_s=0.8)
    assert parse_slo("ttft_ms_per_token=2,tpot_ms=100").ttft_target_s(500) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="presets"):
        parse_slo("nope")
    with pytest.raises(ValueError, match="tpot_ms is required"):
        parse_slo("ttft_ms=800")
    with pytest.raises(ValueError, match="exactly one"):
        SLO("x", tpot_s=0.1)


def test_summary_of_the_recorded_run():
    s = summarize(RUN, duration_s=2.0, slos=[PRESETS["relaxed"], PRESETS["strict"]])
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (6, 5, 1)
    assert s["num_output_length_mismatch"] == 0
    assert s["total_output_tokens"] == 11 + 11 + 5 + 1 + 6
    assert s["total_prompt_tokens"] == 100 + 400 + 1000 + 10 + 200
    assert s["request_throughput_rps"] == 2.5
    assert s["output_throughput_tps"] == 17.0
    # TTFT of the completed: 250, 750, 1500, 125, 375 ms
    assert s["ttft_ms"]["mean"] == pytest.approx(600.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(375.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(750 + 0.6 * 750)  # numpy linear: between 750 and 1500
    assert s["tpot_ms"]["p50"] == pytest.approx(30.0)  # 20, 40, 10, 62.5 -> median 30
    assert s["itl_ms"]["mean"] == pytest.approx(30.0)  # 10, 30, 50
    assert s["slo"]["relaxed"]["attainment"] == 0.5 and s["slo"]["relaxed"]["num_met"] == 3
    assert s["slo"]["strict"]["good_request_throughput_rps"] == 1.0
    assert s["slo"]["strict"]["description"] == "strict: TTFT <= 500 ms, TPOT <= 25 ms"


def test_goodput_bracketed_and_interpolated():
    g = goodput([(4, 0.5), (1, 0.99), (2, 0.95), (3, 0.85)], "relaxed")
    assert g.measured_rps == 2 and g.is_bracketed
    assert g.interpolated_rps == pytest.approx(2.5)  # 0.95 -> 0.85 crosses 0.9 halfway
    assert g.points == [(1, 0.99), (2, 0.95), (3, 0.85), (4, 0.5)]


def test_goodput_takes_the_highest_meeting_rate_even_after_a_dip():
    g = goodput([(1, 0.95), (2, 0.8), (3, 0.92), (4, 0.7)], "s")
    assert g.measured_rps == 3 and g.interpolated_rps == pytest.approx(3 + 0.02 / 0.22)


def test_goodput_edges():
    none = goodput([(1, 0.5), (2, 0.1)], "s")
    assert none.measured_rps == 0.0 and none.interpolated_rps is None
    top = goodput([(1, 0.99), (2, 0.95)], "s")
    assert top.measured_rps == 2 and top.interpolated_rps == 2 and not top.is_bracketed
    assert goodput([(float("inf"), 1.0)], "s").measured_rps == 0.0
