"""benchmarks/replay_order on a tiny synthetic run: the prefill-queue replay and its command line."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from benchmarks.replay_order import Arrival, load_step_rate, main, replay, sigma_for_p90_error
from bullet_ray.policy.slo import SloTargets


def test_an_idle_prefill_side_serves_each_request_alone():
    arrivals = [Arrival("a", 0.0, 1000), Arrival("b", 1.0, 2000)]
    assert replay(arrivals, 10_000.0, SloTargets(0.5), overhead_s=0.01) == pytest.approx([0.11, 0.21])


def test_a_margin_sends_a_request_inside_it_to_the_back():
    # "x" alone takes 0.47 s: it makes 0.5 s served first, not 0.45 s; "y" (0.2 s) goes first once x is lost
    arrivals = [Arrival("x", 0.0, 4700), Arrival("y", 0.0, 2000)]
    assert replay(arrivals, 10_000.0, SloTargets(0.5)) == pytest.approx([0.47, 0.67])
    assert replay(arrivals, 10_000.0, SloTargets(0.5, margin_s=0.05)) == pytest.approx([0.67, 0.2])


def test_noise_is_lognormal_around_the_prediction():
    assert sigma_for_p90_error(0.105) == pytest.approx(0.0607, abs=1e-4)
    arrivals = [Arrival(str(i), i * 0.5, 1000) for i in range(50)]
    ttfts = replay(arrivals, 10_000.0, SloTargets(0.5), noise_sigma=0.06, rng=random.Random(1))
    assert 0.09 < sorted(ttfts)[25] < 0.11 and len(set(ttfts)) > 1


def test_the_command_line_reads_a_run_and_a_step_log(tmp_path, capsys):
    run = tmp_path / "run.json.gz"
    requests = [{"index": i, "scheduled_s": i * 0.05, "prompt_tokens": 500 + 100 * i, "ttft_s": 0.1 + 0.2 * (i % 4),
                 "success": True} for i in range(12)]
    with gzip.open(run, "wt") as f:
        json.dump({"requests": requests}, f)
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(json.dumps({"kind": "step", "side": "prefill", "phase": "prefill", "num_tokens": n,
                                           "prefill_sms": 116, "predicted_ms": n / 20, "measured_ms": n / 20 * 1.05})
                               for n in (1600, 2000, 400)) + "\n")
    assert load_step_rate(steps).tokens_per_s == pytest.approx(20_000 / 1.05)
    out = tmp_path / "out.json"
    assert main(["--run", str(run), "--steps", str(steps), "--margins", "0,50", "--seeds", "2",
                 "--json", str(out)]) == 0
    assert "measured TTFT <= 500 ms: 75.0%" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["margin_ms"] for r in doc["rows"]] == [0.0, 50.0] and all(0 <= r["mean"] <= 1 for r in doc["rows"])
