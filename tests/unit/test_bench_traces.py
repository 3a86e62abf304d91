"""Workloads: seeded arrivals and lengths repeat, Poisson mean rate, Azure trace parsing and replay scaling,
length clipping. No server, no tokenizer."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bullet_ray.bench.traces import (
    WorkloadConfig,
    build_workload,
    clip_lengths,
    default_trace_dir,
    load_azure_trace,
    parse_timestamp_s,
    poisson_arrivals_s,
    trace_arrivals_s,
)

CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:05.5000000,110,27
2023-11-16 18:17:07.9799600,7433,14
"""


@pytest.fixture
def trace_csv(tmp_path: Path) -> Path:
    path = tmp_path / "conv.csv"
    path.write_text(CSV)
    return path


def test_poisson_repeats_with_a_seed_and_differs_across_seeds():
    a, b = poisson_arrivals_s(500, 4.0, seed=7), poisson_arrivals_s(500, 4.0, seed=7)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, poisson_arrivals_s(500, 4.0, seed=8))
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_poisson_mean_rate(burstiness):
    times = poisson_arrivals_s(20000, 8.0, seed=1, burstiness=burstiness)
    assert (len(times) - 1) / times[-1] == pytest.approx(8.0, rel=0.05)


def test_rates_stretch_the_same_pattern():
    assert np.allclose(poisson_arrivals_s(100, 2.0, seed=3), poisson_arrivals_s(100, 1.0, seed=3) / 2.0)
    assert np.array_equal(poisson_arrivals_s(5, None, seed=3), np.zeros(5))


def test_timestamp_with_seven_fractional_digits():
    assert parse_timestamp_s("2023-11-16 18:17:04.0319600") - parse_timestamp_s("2023-11-16 18:17:03.9799600") \
        == pytest.approx(0.052, abs=1e-6)


def test_trace_parsing_sorts_and_offsets(trace_csv):
    trace = load_azure_trace(str(trace_csv))
    assert trace.num_requests == 4
    assert np.allclose(trace.arrival_s, [0.0, 0.052, 1.52004, 4.0], atol=1e-6)
    assert trace.prompt_tokens.tolist() == [4808, 3180, 110, 7433]
    assert trace.output_tokens.tolist() == [10, 8, 27, 14]
    assert trace.mean_rate_rps == pytest.approx(3 / 4.0)


def test_trace_replay_scaling_and_window(trace_csv):
    trace = load_azure_trace(str(trace_csv))
    arrivals, rows = trace_arrivals_s(trace, scale=2.0)
    assert np.allclose(arrivals, trace.arrival_s / 2.0) and rows.tolist() == [0, 1, 2, 3]
    arrivals, rows = trace_arrivals_s(trace, scale=0.5, start_s=1.0)
    assert rows.tolist() == [2, 3] and np.allclose(arrivals, [0.0, (4.0 - 1.52004) * 2])
    cfg = WorkloadConfig(dataset="azure-conv", trace_path=str(trace_csv), trace_scale=4.0, num_prompts=3, rate_rps=None)
    specs = build_workload(cfg)
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.013, 0.38001], abs=1e-6)
    assert [(s.prompt_tokens, s.output_tokens) for s in specs] == [(4808, 10), (3180, 8), (110, 27)]
    assert all(isinstance(s.prompt, list) and len(s.prompt) == s.prompt_tokens for s in specs)


def test_poisson_over_trace_lengths_uses_the_trace_pairs(trace_csv):
    cfg = WorkloadConfig(dataset="azure-code", trace_path=str(trace_csv), rate_rps=2.0, num_prompts=10, seed=5,
                         max_prompt_tokens=4096)
    specs = build_workload(cfg)
    pairs = {(min(p, 4096), o) for p, o in [(4808, 10), (3180, 8), (110, 27), (7433, 14)]}
    assert len(specs) == 10 and {(s.prompt_tokens, s.output_tokens) for s in specs} == pairs  # 2.5 passes
    assert specs == build_workload(cfg)


def test_random_workload_repeats_and_is_prefix_stable():
    cfg = WorkloadConfig(dataset="random", num_prompts=20, rate_rps=5.0, seed=11, random_input_tokens=64,
                         random_output_tokens=16)
    a = build_workload(cfg)
    assert a == build_workload(cfg)
    assert a != build_workload(replace(cfg, seed=12))
    assert build_workload(replace(cfg, num_prompts=8)) == a[:8]  # request i does not depend on the total
    faster = build_workload(replace(cfg, rate_rps=10.0))  # same requests, closer together
    assert [(s.prompt, s.output_tokens) for s in faster] == [(s.prompt, s.output_tokens) for s in a]
    assert [s.arrival_s for s in faster] == pytest.approx([s.arrival_s / 2 for s in a])
    assert all(32 <= s.prompt_tokens <= 96 and 8 <= s.output_tokens <= 24 for s in a)
    assert all(len(s.prompt) == s.prompt_tokens and all(1000 <= t < 30000 for t in s.prompt) for s in a)
    assert len({tuple(s.prompt) for s in a}) == 20  # distinct prompts: no accidental prefix-cache hits


def test_duration_cuts_arrivals():
    cfg = WorkloadConfig(dataset="random", num_prompts=None, duration_s=10.0, rate_rps=20.0, seed=2,
                         random_distribution="fixed", random_input_tokens=4, random_output_tokens=2)
    specs = build_workload(cfg)
    assert all(s.arrival_s < 10.0 for s in specs) and 150 < len(specs) < 250
    assert {(s.prompt_tokens, s.output_tokens) for s in specs} == {(4, 2)}


def test_clipping():
    cfg = WorkloadConfig(max_prompt_tokens=1000, max_output_tokens=100, max_total_tokens=1024)
    assert clip_lengths(5000, 500, cfg) == (924, 100)
    assert clip_lengths(10, 20, cfg) == (10, 20)
    assert clip_lengths(0, 0, WorkloadConfig()) == (1, 1)
    assert clip_lengths(10, 2000, WorkloadConfig(max_total_tokens=512)) == (1, 511)


def test_bad_configs_name_the_fix(trace_csv):
    with pytest.raises(ValueError, match="not both"):
        build_workload(WorkloadConfig(dataset="azure-conv", rate_rps=1.0, trace_scale=1.0))
    with pytest.raises(ValueError, match="needs a tokenizer"):
        build_workload(WorkloadConfig(prompt_mode="text"))
    with pytest.raises(ValueError, match="sharegpt-path"):
        build_workload(WorkloadConfig(dataset="sharegpt", rate_rps=1.0))
    with pytest.raises(ValueError, match="use rate_rps"):
        build_workload(WorkloadConfig(dataset="random", trace_scale=2.0))
    with pytest.raises(FileNotFoundError, match="--trace-path"):
        build_workload(WorkloadConfig(dataset="azure-conv", trace_path=str(trace_csv.parent / "nope")))


@pytest.mark.skipif(not (default_trace_dir() / "conv.csv").is_file(), reason="Azure traces not next to the repo")
def test_the_shared_azure_traces():
    conv = load_azure_trace(str(default_trace_dir() / "conv.csv"))
    code = load_azure_trace(str(default_trace_dir() / "code.csv"))
    assert (conv.num_requests, code.num_requests) == (19366, 8819)
    assert conv.mean_rate_rps == pytest.approx(5.5, abs=0.1) and code.mean_rate_rps == pytest.approx(2.6, abs=0.1)
    assert (conv.prompt_tokens[0], conv.output_tokens[0]) == (374, 44)


def test_prompt_salt_gives_new_prompts_with_the_same_lengths_and_arrivals():
    """A rate sweep salts each rate's prompts, so a server's prefix cache cannot serve one rate from another."""
    cfg = WorkloadConfig(dataset="random", num_prompts=10, rate_rps=5.0, seed=3, random_input_tokens=64,
                         random_output_tokens=16)
    a, b = build_workload(cfg), build_workload(replace(cfg, prompt_salt=2))
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in a] == \
        [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in b]
    assert all(x.prompt[:8] != y.prompt[:8] for x, y in zip(a, b))
