"""Serving-benchmark pieces without a server: workloads repeat with a seed, trace parsing, SLO math."""

from __future__ import annotations

import pytest

from benchmarks.slo import Slo, attainment, goodput
from benchmarks.traces import build_workload, poisson_arrivals, read_azure


def test_seeded_workload_repeats_and_seeds_differ():
    a = build_workload("azure-conv", 50, seed=3, rate=4.0)
    b = build_workload("azure-conv", 50, seed=3, rate=4.0)
    c = build_workload("azure-conv", 50, seed=4, rate=4.0)
    assert a == b and a != c
    assert all(r.prompt_tokens <= 4096 and r.output_tokens >= 1 for r in a)


def test_poisson_mean_rate():
    times = poisson_arrivals(10.0, 5000, seed=1)
    assert times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(10.0, rel=0.05)


def test_azure_trace_parsing_and_replay_scale():
    rows = read_azure("conv")
    assert rows[0][0] == 0.0 and rows[0][1:] == (374, 44)
    assert len(rows) > 1000
    replay = build_workload("azure-conv", 10, seed=0, trace_scale=2.0)
    assert [r.arrival_s for r in replay] == [t / 2.0 for t, _, _ in rows[:10]]


def test_random_dataset_needs_a_rate():
    with pytest.raises(ValueError, match="rate"):
        build_workload("random", 5, seed=0)
    with pytest.raises(ValueError, match="unknown dataset"):
        build_workload("nope", 5, seed=0, rate=1)


def _rec(ttft, tpot, prompt=100, ok=True):
    return {"ok": ok, "ttft_s": ttft, "tpot_s": tpot, "prompt_tokens": prompt}


def test_attainment_on_a_recorded_run_with_known_answers():
    records = [_rec(0.2, 0.01), _rec(0.9, 0.049), _rec(1.1, 0.01), _rec(0.3, 0.06), _rec(0.1, 0.01, ok=False)]
    assert attainment(records, Slo.preset("relaxed")) == pytest.approx(2 / 5)
    assert attainment(records, Slo.preset("strict")) == pytest.approx(1 / 5)
    # per-token TTFT: ShareGPT gives 3 ms per prompt token -> 0.3 s for 100 tokens
    assert attainment(records, Slo.preset("sharegpt")) == pytest.approx(2 / 5)


def test_goodput_is_the_highest_rate_meeting_90_percent():
    assert goodput({1.0: 1.0, 2.0: 0.95, 4.0: 0.91, 8.0: 0.5}) == 4.0
    assert goodput({1.0: 0.5}) == 0.0
