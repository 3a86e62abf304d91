"""benchmarks/replay_order on a tiny synthetic run: the prefill-queue replay and its command line."""

from __future__ import annotations

import gzip
import json
import random

import pytest

from benchmarks import replay_order
from benchmarks.replay_order import (
    Arrival,
    StepCost,
    fit_step_cost,
    load_step_rate,
    main,
    prefill_steps,
    replay,
    sigma_for_p90_error,
)
from bullet_ray.policy.slo import SloTargets


def test_an_idle_prefill_side_serves_each_request_alone():
    arrivals = [Arrival("a", 0.0, 1000), Arrival("b", 1.0, 2000)]
    assert replay(arrivals, 10_000.0, SloTargets(0.5), overhead_s=0.01) == pytest.approx([0.11, 0.21])
    assert replay(arrivals, 10_000.0, SloTargets(0.5), overhead_s=0.01, planner="fill") == pytest.approx([0.11, 0.21])


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
    assert load_step_rate(prefill_steps(steps)).tokens_per_s == pytest.approx(20_000 / 1.05)
    out = tmp_path / "out.json"
    assert main(["--run", str(run), "--steps", str(steps), "--margins", "0,50", "--seeds", "2",
                 "--json", str(out)]) == 0
    assert "measured TTFT <= 500 ms: 75.0%" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["margin_ms"] for r in doc["rows"]] == [0.0, 50.0] and all(0 <= r["mean"] <= 1 for r in doc["rows"])
    # fallback targets: every margin with each; judged at the second bound too
    assert main(["--run", str(run), "--steps", str(steps), "--margins", "50", "--fallback-ms", "none,1000",
                 "--seeds", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["fallback_ms"] for r in rows] == [None, 1000.0] and all(0 <= r["mean_within_1000ms"] <= 1 for r in rows)
    for bad in ("400", "x"):
        with pytest.raises(SystemExit, match="--fallback-ms"):
            main(["--run", str(run), "--steps", str(steps), "--fallback-ms", bad])
    # orders: one row per order, margin and fallback
    assert main(["--run", str(run), "--steps", str(steps), "--margins", "50", "--order", "least_slack,max_on_time",
                 "--seeds", "2", "--json", str(out)]) == 0
    assert [r["order"] for r in json.loads(out.read_text())["rows"]] == ["least_slack", "max_on_time"]
    with pytest.raises(SystemExit, match="--order"):
        main(["--run", str(run), "--steps", str(steps), "--order", "edf"])
    # fallback_first replays with a fallback target only
    assert main(["--run", str(run), "--steps", str(steps), "--margins", "50", "--order", "fallback_first",
                 "--fallback-ms", "1000", "--seeds", "2", "--json", str(out)]) == 0
    assert [r["order"] for r in json.loads(out.read_text())["rows"]] == ["fallback_first"]
    with pytest.raises(SystemExit, match="give --fallback-ms"):
        main(["--run", str(run), "--steps", str(steps), "--order", "fallback_first"])


def test_max_on_time_gives_up_the_long_prompt_that_would_make_the_others_late():
    # at 0: x (0.4 s), a (0.2 s) and four 0.05 s prompts, 0.5 s targets. Least slack runs x first (the least slack,
    # 0.1 s); behind it only one more makes 0.5 s. max_on_time gives x up: the four and a make it, then x (late)
    arrivals = [Arrival("x", 0.0, 4000), Arrival("a", 0.0, 2000), *(Arrival(f"s{i}", 0.0, 500) for i in range(4))]
    plain = replay(arrivals, 10_000.0, SloTargets(0.5), cap_tokens=500)
    mot = replay(arrivals, 10_000.0, SloTargets(0.5), cap_tokens=500, order="max_on_time")
    assert plain[0] == pytest.approx(0.4) and sum(t <= 0.5 for t in plain) == 2
    assert mot == pytest.approx([0.8, 0.4, 0.05, 0.1, 0.15, 0.2])


def test_a_fallback_target_serves_a_lost_request_before_it_is_lost_for_good():
    # "x" (0.47 s) makes 0.5 s only first; with it first "y" waits past its 0.45 s (planned) target either way.
    # Margin 50: x is lost and goes last (0.67 s). With a 1 s fallback x still goes last: it makes 1 s there and the
    # slack before y is y's own
    arrivals = [Arrival("x", 0.0, 4700), Arrival("y", 0.0, 2000)]
    fb = SloTargets(0.5, margin_s=0.05, fallback_ttft_s=1.0)
    assert replay(arrivals, 10_000.0, fb) == pytest.approx([0.67, 0.2])
    # six 0.1 s requests with y: without a fallback x waits for every one that can still make 0.45 s and misses 1 s;
    # with it x goes just in time for 1 s, and the four that made 0.45 s still do
    crowd = [*arrivals, *(Arrival(f"z{i}", 0.0, 1000) for i in range(6))]
    rescued, plain = replay(crowd, 10_000.0, fb), replay(crowd, 10_000.0, SloTargets(0.5, margin_s=0.05))
    assert rescued[0] <= 1.0 < plain[0]
    assert rescued[2:6] == pytest.approx([0.4] * 4) and plain[2:6] == pytest.approx([0.4] * 4)


def test_planning_ahead_commits_the_next_batch_before_a_later_arrival():
    # a and c (1,000 tokens each, 0.1 s, target 1 s) at 0; b (100 tokens, target 0.1 s) arrives at 0.05, while a
    # runs. Planned when the side is free, b (least slack) goes next, alone; planned as a launches (the engine's
    # way), c was already committed and b waits for it
    arrivals = [Arrival("a", 0.0, 1000), Arrival("c", 0.0, 1000), Arrival("b", 0.05, 100)]
    targets = SloTargets(0.1, ttft_per_token_s=0.001)
    free = replay(arrivals, 10_000.0, targets, cap_tokens=1000, plan_ahead=False)
    ahead = replay(arrivals, 10_000.0, targets, cap_tokens=1000, plan_ahead=True)
    assert free == pytest.approx([0.1, 0.21, 0.06])
    assert ahead == pytest.approx([0.1, 0.2, 0.16])


def test_the_linear_step_model_is_fitted_from_the_log(tmp_path):
    truth = StepCost(0.007, 31e-6, 0.6e-9)
    steps = tmp_path / "steps.jsonl"
    rows = []
    for n, seqs in [(200, 1), (900, 2), (1500, 1), (2100, 3), (3000, 2), (3600, 1), (4000, 4), (5000, 1), (700, 1)]:
        q = n // seqs
        pairs = seqs * (q * (q + 1) // 2)
        rows.append({"kind": "step", "side": "prefill", "phase": "prefill", "num_tokens": n, "prefill_sms": 116,
                     "num_attention_pairs": pairs, "predicted_ms": 1.0,
                     "measured_ms": (truth.fixed_s + truth.per_token_s * n + truth.per_pair_s * pairs) * 1e3})
    steps.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    fitted = fit_step_cost(prefill_steps(steps))
    assert fitted is not None
    cost, error, steps_fitted = fitted
    assert steps_fitted == 9
    assert cost.fixed_s == pytest.approx(truth.fixed_s, rel=1e-6) and cost.per_token_s == pytest.approx(
        truth.per_token_s, rel=1e-6) and error < 1e-9
    assert cost.seconds([(1000, 0)]) == pytest.approx(0.007 + 0.031 + 0.6e-9 * 500500)
    assert fit_step_cost(prefill_steps(steps), prefill_sms=100) is None  # no steps on that entry


def test_a_prompt_chunked_over_several_batches_gets_its_first_token_after_its_last_chunk():
    # 3,000 tokens at 10k tokens/s in batches of at most 1,000: three 0.1 s steps, the first token after the third
    for plan_ahead in (True, False):
        assert replay([Arrival("a", 0.0, 3000)], 10_000.0, SloTargets(5.0), cap_tokens=1000,
                      plan_ahead=plan_ahead) == pytest.approx([0.3])
    # cut to fill: b's first 800 tokens share a's batch, its last 800 the next one
    assert replay([Arrival("a", 0.0, 200), Arrival("b", 0.0, 1600)], 10_000.0, SloTargets(5.0),
                  cap_tokens=1000, planner="fill") == pytest.approx([0.1, 0.18])
    for bad in ({"cap_tokens": 0}, {"token_budget": 0}):
        with pytest.raises(ValueError, match="cap_tokens and token_budget"):
            replay([Arrival("a", 0.0, 10)], 10_000.0, SloTargets(5.0), **bad)


def test_the_bullet_planner_batches_whole_requests_of_similar_length(monkeypatch):
    # a (100), b (600), c (120) at 0, targets 75 ms, cap 800. The order is c, b, a (b has the least slack, c passes
    # it, a cannot: b would end at 82 ms). c's batch takes a, its length bucket's, not b, the order's next: b waits
    # (and misses); taking the order's next instead would make a wait
    arrivals = [Arrival("a", 0.0, 100), Arrival("b", 0.0, 600), Arrival("c", 0.0, 120)]
    targets = SloTargets(0.075)
    assert replay(arrivals, 10_000.0, targets, cap_tokens=800) == pytest.approx([0.022, 0.082, 0.022])
    one_bucket = replay_order.LengthBuckets
    monkeypatch.setattr(replay_order, "LengthBuckets", lambda: one_bucket([0]))  # every length in one bucket
    assert replay(arrivals, 10_000.0, targets, cap_tokens=800) == pytest.approx([0.082, 0.072, 0.072])
    monkeypatch.undo()
    filled = replay(arrivals, 10_000.0, targets, cap_tokens=800, planner="fill")
    assert filled == pytest.approx([0.082, 0.072, 0.072])  # by the order: b beside c; a, cut to fill, would make c late
    # the head's target keeps others out (BulletPolicy.plan's fit): y (least slack) runs alone, since with x beside
    # it it would end at 39 ms, past its 38
    tight = [Arrival("x", 0.0, 200), Arrival("y", 0.0, 190)]
    per_token = SloTargets(0.025, ttft_per_token_s=0.0002)  # x: 40 ms, y: 38 ms
    assert replay(tight, 10_000.0, per_token, cap_tokens=800) == pytest.approx([0.039, 0.019])
    with pytest.raises(ValueError, match="planner"):
        replay(arrivals, 10_000.0, targets, planner="greedy")
