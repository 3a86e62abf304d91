"""Per-step records: the state block's rings and policy slots, the metrics they feed, and the JSONL plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from bullet_ray.engine.state_block import RING_SIZE, Side, StateBlock
from bullet_ray.metrics import EngineMetrics


def test_step_ring_keeps_the_last_steps_in_order(tmp_path: Path):
    block = StateBlock.create(str(tmp_path / "state"))
    try:
        for i in range(RING_SIZE + 10):
            block.annotate(Side.DECODE, predicted_step_us=100 + i, queued_tokens=0, is_active=True)
            block.record_ring(Side.DECODE, 200 + i, 100 + i, 3)  # before publish counts the step
            if i == 0:  # entered, not yet counted: no reader sees it
                assert block.recent_steps(Side.DECODE, 0) == (0, [])
            block.publish(Side.DECODE, num_seqs=4, num_tokens=4, num_context_tokens=400, step_time_us=200 + i,
                          num_queued=0, split_index=3)
        step, entries = block.recent_steps(Side.DECODE, 0)
        # the oldest 10 were overwritten, and the oldest slot left is the next step's (entered before its count)
        assert step == RING_SIZE + 10 and len(entries) == RING_SIZE - 1
        assert entries[0] == (211, 111, 3) and entries[-1] == (200 + RING_SIZE + 9, 100 + RING_SIZE + 9, 3)
        assert block.recent_steps(Side.DECODE, step - 2)[1] == entries[-2:]
        assert block.read(Side.DECODE)["is_active"] == 1
        assert block.recent_steps(Side.PREFILL, 0) == (0, [])
        # a decision that asks for a switch, completed by the side that acks last
        block.record_decision(5, 2, 80, 250_000, is_switch=True)
        assert block.read_policy()["pending_switch_us"] > 0
        latency = block.record_switch_done()
        assert latency is not None and latency >= 0
        assert block.record_switch_done() is None  # nothing pending any more
        n, switches = block.recent_switches(0)
        assert n == 1 and switches == [latency]
        # the front's request_split (by hand, or into the controller's bounds): timed where a side must move
        assert block.request_switch(2)
        assert block.record_switch_done() is None  # not settled: the sides have not acked entry 2 yet
        block.switch[1] = block.switch[2] = 2  # both sides acked
        by_hand = block.record_switch_done()
        assert by_hand is not None and block.recent_switches(0) == (2, [latency, by_hand])
        assert not block.request_switch(2)  # both run on 2 already: nothing to time
        assert block.read_policy()["pending_switch_us"] == 0
        policy = block.read_policy()
        assert policy["decision_index"] == 5 and policy["predicted_ttft_us"] == 250_000
    finally:
        block.close()


def test_a_switch_completed_by_both_sides_at_once_is_counted_once(tmp_path: Path):
    """Both sides may see a switch settled and call record_switch_done together: the check-then-write runs under
    a lock across processes (flock on the block's file; each attached block holds its own descriptor), so the
    second caller waits for the first and finds nothing pending."""
    import threading

    block = StateBlock.create(str(tmp_path / "state"))
    other = StateBlock.attach(block.export())  # what the other worker process holds
    try:
        block.record_decision(5, 2, 80, 250_000, is_switch=True)
        holding, release = threading.Event(), threading.Event()
        first: list = []

        def first_side() -> None:
            with block._locked():  # the first side is inside its check-then-write
                holding.set()
                release.wait(5)
                first.append(block._record_switch_done())

        thread = threading.Thread(target=first_side)
        thread.start()
        assert holding.wait(5)
        threading.Timer(0.1, release.set).start()
        assert other.record_switch_done() is None  # it waited for the first, then nothing was pending
        assert first and first[0] is not None  # the first had recorded before the second got the lock
        thread.join(5)
        assert block.read_policy()["num_switches"] == 1
    finally:
        other.close()
        block.close()


def test_a_switch_drains_once_no_step_of_either_side_runs_on_the_old_entry(tmp_path: Path):
    """Both sides ack a switch at their next launch; a step launched before (ahead, or in flight in overlap mode)
    still runs on the old entry. The drain is timed when each side's oldest step in flight is on the new entry or
    none is; a newer request before then leaves it untimed and counted as overtaken."""
    block = StateBlock.create(str(tmp_path / "state"))
    other = StateBlock.attach(block.export())  # the other worker's view
    try:
        block.set_inflight_index(Side.DECODE, 5)  # decode's step launched ahead on the old entry
        block.record_decision(3, 2, 80, 250_000, is_switch=True)
        block.switch[0] = 3  # requested ...
        assert block.record_drain_if_done() is None  # nothing settled yet
        block.switch[1] = block.switch[2] = 3  # ... and acked by both
        acked = block.record_switch_done()
        assert acked is not None
        assert block.record_drain_if_done() is None  # decode's old step still runs
        block.set_inflight_index(Side.PREFILL, 3)  # prefill launched on the new entry
        assert other.record_drain_if_done() is None
        other.set_inflight_index(Side.DECODE, None)  # decode collected its old step, nothing else in flight
        done = other.record_drain_if_done()
        assert done is not None and done[1] == 3
        drained = done[0]
        assert drained >= acked
        assert block.record_drain_if_done() is None  # timed once
        assert block.recent_drains(0) == (1, [drained])
        policy = block.read_policy()
        assert policy["num_drains"] == 1 and policy["last_drain_us"] == drained
        assert policy["num_drains_overtaken"] == 0 and policy["drain_start_us"] == 0
        # a switch that settles with nothing on the old entry drains at once
        block.record_decision(4, 2, 80, 250_000, is_switch=True)
        block.switch[:3] = 4
        assert block.record_switch_done() is not None
        block.set_inflight_index(Side.PREFILL, 4)
        assert block.record_drain_if_done() is not None and block.recent_drains(1)[0] == 2
        # overtaken: a newer request before the old steps end
        block.set_inflight_index(Side.DECODE, 4)
        block.record_decision(6, 2, 80, 250_000, is_switch=True)
        block.switch[:3] = 6
        assert block.record_switch_done() is not None
        block.switch[0] = 2  # the next request, before decode's step on entry 4 ended
        assert block.record_drain_if_done() is None
        block.set_inflight_index(Side.DECODE, None)
        assert block.record_drain_if_done() is None  # nothing is waiting any more
        policy = block.read_policy()
        assert policy["num_drains"] == 2 and policy["num_drains_overtaken"] == 1
        # a switch that settles while the last one's old steps still run overtakes it too
        block.switch[:3] = 2
        block.set_inflight_index(Side.DECODE, 6)
        block.record_decision(2, 2, 80, 250_000, is_switch=True)
        assert block.record_switch_done() is not None and block.record_drain_if_done() is None
        block.record_decision(1, 2, 80, 250_000, is_switch=True)
        block.switch[:3] = 1
        assert block.record_switch_done() is not None
        assert block.read_policy()["num_drains_overtaken"] == 2
    finally:
        other.close()
        block.close()


def test_decisions_are_counted_by_reason_and_exported_as_increments(tmp_path: Path):
    """The state block counts each split decision under its reason; the metrics add each reason's new decisions to
    a counter (a new engine's counts start again: no negative increment)."""

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        for reason in (0, 0, 7, 9):
            block.record_decision(1, reason, 10, 0, is_switch=False)
        counts = block.read_decisions_by_reason()
        assert counts[0] == 2 and counts[7] == 1 and counts[9] == 1 and sum(counts) == 4
        assert block.read_policy()["num_decisions"] == 4 and "decisions_by_reason" not in block.read_policy()
    finally:
        block.close()
    metrics = EngineMetrics("m", "e")
    added: list[tuple[int, str]] = []
    metrics.decisions = SimpleNamespace(inc=lambda n, tags: added.append((n, tags["reason"])))

    def observe(by_reason: dict[str, int]) -> None:
        metrics.observe_stats(SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, predicted_ttft_s=None,
                                              extra={"policy": {"num_decisions": sum(by_reason.values()),
                                                                "decision_cost_us": 5,
                                                                "decisions_by_reason": by_reason}}))
    observe({"balance": 2, "hold": 5})
    observe({"balance": 3, "hold": 5, "backlog": 1})
    observe({"balance": 1})  # a restarted engine: counts start again
    observe({"balance": 4})
    assert added == [(2, "balance"), (5, "hold"), (1, "balance"), (1, "backlog"), (3, "balance")]


def test_gc_metrics_add_what_each_process_collected_since_the_last_read(tmp_path: Path):
    """Each worker's garbage collections so far travel in its state-block row (the front reads them with the
    engine's stats); the counters get what was added since the last read, per process; a restarted worker's
    smaller totals start again."""
    block = StateBlock.create(str(tmp_path / "state"))
    try:
        block.publish(Side.DECODE, num_seqs=1, num_tokens=1, num_context_tokens=9, step_time_us=10, num_queued=0,
                      gc_us=2500, gc_count=7)
        row = block.read(Side.DECODE)
        assert (row["gc_us"], row["gc_count"]) == (2500, 7)
        block.publish(Side.DECODE, num_seqs=1, num_tokens=1, num_context_tokens=9, step_time_us=10, num_queued=0)
        assert block.read(Side.DECODE)["gc_count"] == 0  # a publish without totals writes zeros
        assert block.read(Side.PREFILL)["gc_us"] == 0
    finally:
        block.close()
    metrics = EngineMetrics("m", "e")
    seconds: list[tuple[float, str]] = []
    counts: list[tuple[int, str]] = []
    metrics.gc_seconds = SimpleNamespace(inc=lambda v, tags: seconds.append((round(v, 6), tags["process"])))
    metrics.gc_collections = SimpleNamespace(inc=lambda n, tags: counts.append((n, tags["process"])))

    def observe(**totals: tuple[float, int]) -> None:
        gc = {p: {"seconds": s, "collections": n} for p, (s, n) in totals.items()}
        metrics.observe_stats(SimpleNamespace(num_running=0, num_waiting=0, kv_usage=0.0, predicted_ttft_s=None,
                                              extra={"gc": gc}))
    observe(decode=(0.0025, 7), prefill=(0.0, 0))
    observe(decode=(0.0025, 7), prefill=(0.001, 3))  # nothing new from decode: nothing added
    metrics.observe_gc({"front": {"seconds": 0.004, "collections": 2}})  # the replica's own (EngineReplica)
    observe(decode=(0.0005, 1), prefill=(0.003, 5))  # decode restarted: its totals count from 0 again
    observe(decode=(0.0001, 4), prefill=(0.003, 5))  # again, its first read already past the old count: by the time
    assert seconds == [(0.0025, "decode"), (0.001, "prefill"), (0.004, "front"), (0.0005, "decode"),
                       (0.002, "prefill"), (0.0001, "decode")]
    assert counts == [(7, "decode"), (3, "prefill"), (2, "front"), (1, "decode"), (2, "prefill"), (4, "decode")]


def test_metrics_take_step_records_outside_ray():
    metrics = EngineMetrics("m", "e")  # Ray's metrics are no-ops outside a Ray worker
    metrics.observe_steps({"prefill": [(0.05, 0.045, 0)], "decode": [(0.02, 0.021, 6), (0.0, 0.0, 6)],
                           "switch_s": [0.0004], "switch_drain_s": [0.02], "handoff_s": [0.003]})


def test_slo_metric_judges_ttft_against_the_per_prompt_token_target():
    """With a per-prompt-token TTFT target a request meets TTFT within max(floor, per-token x its prompt tokens);
    a controller's push moves the floor and keeps the per-token part; without one, the fixed target judges."""
    per_token = EngineMetrics("m", "e", ttft_target_s=0.5, tpot_target_s=0.2, ttft_per_token_s=0.0015)
    tpot_ok = 10 * 0.1  # e2e = TTFT + 10 more tokens at 100 ms each
    assert per_token.meets_slo(1.4, 1.4 + tpot_ok, 11, num_prompt_tokens=1000)  # target 1.5 s
    assert not per_token.meets_slo(1.6, 1.6 + tpot_ok, 11, num_prompt_tokens=1000)
    assert per_token.meets_slo(0.45, 0.45 + tpot_ok, 11, num_prompt_tokens=100)  # 0.15 s x tokens: the floor's 0.5
    assert not per_token.meets_slo(0.55, 0.55 + tpot_ok, 11, num_prompt_tokens=100)
    assert not per_token.meets_slo(1.4, 1.4 + 10 * 0.3, 11, num_prompt_tokens=1000)  # TPOT 300 ms > 200 ms
    per_token.set_targets(0.1, 0.2)
    assert per_token.targets.ttft_per_token_s == 0.0015 and per_token.ttft_target_s == 0.1
    assert per_token.meets_slo(0.12, 0.12 + tpot_ok, 11, num_prompt_tokens=100)  # now max(0.1, 0.15)
    fixed = EngineMetrics("m", "e", ttft_target_s=0.5, tpot_target_s=0.2)
    assert not fixed.meets_slo(1.4, 1.4 + tpot_ok, 11, num_prompt_tokens=1000)
    fixed.finished("stop", 1.4 + tpot_ok, 1.4, 11, num_prompt_tokens=1000)  # Ray's counters: no-ops here


def test_plot_steps_reads_a_log(tmp_path: Path):
    log = tmp_path / "steps.jsonl"
    lines = [{"kind": "decision", "t": 0.0, "index": 0, "reason": "only_prefill", "switch": True,
              "decode_step_ms": None, "num_queued": 2, "decode_seqs": 0, "ttft_at_risk": 0, "cost_us": 90}]
    lines.append({"kind": "decision", "t": 0.1, "index": 3, "reason": "mixed", "switch": True, "num_queued": 4,
                  "decode_seqs": 2, "cost_us": 5})
    for i in range(20):
        side = "prefill" if i % 3 == 0 else "decode"
        phase = "mixed" if side == "decode" and i % 5 == 0 else side  # decode steps with prompt chunks
        lines.append({"kind": "step", "t": 0.01 * i, "side": side, "phase": phase, "num_tokens": 10, "num_seqs": 1,
                      "num_context_tokens": 10, "split_index": i % 4, "decode_sms": 16 + 8 * (i % 4),
                      "prefill_sms": 116 - 8 * (i % 4), "other_busy": True, "num_queued": i % 5,
                      "predicted_ms": 10.0 + i, "measured_ms": 11.0 + i})
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    out = tmp_path / "steps.png"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "benchmarks.plot_steps", str(log), "--out", str(out)],
                            cwd=root, capture_output=True, text=True, check=True)
    assert out.stat().st_size > 1000
    assert "decode" in result.stdout and "median" in result.stdout
    assert "mixed: 2 steps" in result.stdout  # the mixed fallback's decode steps apart from decode's


def test_plot_steps_refuses_a_log_without_split_sides_in_one_line(tmp_path: Path):
    """The chunked schedule's log (one hybrid worker, no split, no predictions): a one-line error, no traceback."""
    from benchmarks.plot_steps import main

    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"kind": "step", "t": 0.0, "side": "hybrid", "phase": "decode", "num_tokens": 1,
                               "num_seqs": 1, "num_queued": 0, "measured_ms": 5.0}) + "\n")
    with pytest.raises(SystemExit, match="no prefill or decode side's steps \\(sides: hybrid\\)"):
        main([str(log), "--out", str(tmp_path / "steps.png")])


def _run(started: float | None) -> dict:
    requests = [{"scheduled_s": 0.1 * i, "ttft_s": 0.2 + 0.1 * i, "tpot_s": 0.02, "success": True} for i in range(8)]
    requests.append({"scheduled_s": 0.9, "ttft_s": None, "tpot_s": None, "success": False})
    return {"config": {"slos": ["strict"], "label": "bullet-slo", "workload": {"rate_rps": 10.0}},
            "environment": {"date_utc": "2026-11-23T19:43:16+00:00", "started_unix_s": started},
            "summary": {"duration_s": 2.0, "slo": {"strict": {"name": "strict", "ttft_s": 0.5, "tpot_s": 0.025,
                                                              "attainment": 0.375}}},
            "requests": requests}


def test_a_run_lines_up_with_a_step_log_by_its_start_time():
    from datetime import datetime

    from benchmarks.plot_steps import request_points, run_start_unix_s

    assert run_start_unix_s(_run(1795462938.25)) == 1795462938.25
    end = datetime.fromisoformat("2026-11-23T19:43:16+00:00").timestamp()
    assert run_start_unix_s(_run(None)) == end - 2.0  # older runs: their end (to the second) minus the duration
    points, slo = request_points(_run(None))
    assert len(points) == 8 and points[3] == (0.30000000000000004, 0.5, 0.02)  # failed requests left out
    assert slo["ttft_s"] == 0.5 and slo["name"] == "strict"


def test_plot_steps_zooms_into_a_run(tmp_path: Path):
    log = tmp_path / "steps.jsonl"
    t0 = 1795462938.0
    lines = [{"kind": "step", "t": t0 + 0.05 * i, "side": "prefill" if i % 3 == 0 else "decode", "phase": "x",
              "num_tokens": 10, "num_seqs": 1 + i % 7, "num_context_tokens": 10, "split_index": i % 4,
              "decode_sms": 16 + 8 * (i % 4), "num_queued": i % 5, "predicted_ms": 10.0 + i,
              "measured_ms": 11.0 + i} for i in range(60)]
    log.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(_run(t0 + 0.5)))
    out = tmp_path / "zoom.png"
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "benchmarks.plot_steps", str(log), "--requests", str(run),
                             "--out", str(out)], cwd=root, capture_output=True, text=True, check=True)
    assert out.stat().st_size > 1000
    assert "decode steps of this run: 28, measured p50" in result.stdout  # i = 10..50 in the 2 s window, 13 of them prefill


def test_split_of_run_counts_decisions_and_decode_sms_in_the_window():
    from benchmarks.plot_steps import split_of_run

    t0 = 1795462938.0

    def decode(t, sms, ms):
        return {"t": t0 + t, "side": "decode", "decode_sms": sms, "measured_ms": ms}

    steps = [decode(-1.0, 40, 99.0), decode(0.1, 16, 20.0), decode(0.2, 16, 24.0), decode(0.3, 32, 12.0),
             decode(1.0, 24, 16.0), {"t": t0 + 0.4, "side": "prefill", "decode_sms": 16, "measured_ms": 80.0},
             {**decode(0.5, 40, 50.0), "phase": "mixed"},  # the mixed fallback's step: not a decode step here
             decode(3.0, 40, 99.0)]  # the first and the last fall outside the run's 2 s
    decisions = [{"t": t0 + 0.1, "reason": "balance", "switch": True}, {"t": t0 + 0.2, "reason": "balance"},
                 {"t": t0 + 0.9, "reason": "backlog", "switch": True}, {"t": t0 + 5.0, "reason": "balance"}]
    split = split_of_run(steps, decisions, _run(t0))
    assert split == {"decisions": {"backlog": {"switched": 1, "logged": 1}, "balance": {"switched": 1, "logged": 2}},
                     "decode_steps": 4, "decode_share_by_sms": {16: 0.5, 24: 0.25, 32: 0.25},
                     "decode_step_ms_p50": 20.0, "decode_step_ms_p90": 24.0}
    assert split_of_run([s for s in steps if s["measured_ms"] == 80.0], decisions, _run(t0)) is None


def test_queued_prefill_batches_and_client_side_figures():
    """plot_steps' prefill batches under a queue and step_breakdown's client-side figures, on hand-made rows."""
    from benchmarks.plot_steps import queued_prefill_batches
    from benchmarks.step_breakdown import client_side

    def step(side, queued, seqs, tokens, ms):
        return {"side": side, "num_queued": queued, "num_seqs": seqs, "num_tokens": tokens, "measured_ms": ms}

    steps = [step("prefill", 0, 1, 500, 20.0), step("prefill", 3, 2, 3000, 100.0), step("prefill", 5, 2, 2000, 80.0),
             step("prefill", 4, 1, 1000, 50.0), step("decode", 9, 40, 40, 10.0)]
    assert queued_prefill_batches(steps) == {"steps": 3, "seqs_p50": 2, "tokens_p50": 2000,
                                             "tokens_per_s": 6000 / 230.0 * 1e3}
    assert queued_prefill_batches(steps, min_queued=6) is None
    run = {"summary": {"tpot_ms": {"p50": 30.0}, "ttft_ms": {"p50": 120.0}},
           "requests": [{"success": True, "output_tokens": 11, "e2e_s": 1.1, "ttft_s": 0.1},
                        {"success": True, "output_tokens": 31, "e2e_s": 1.7, "ttft_s": 0.2},
                        {"success": False, "output_tokens": 0, "e2e_s": 9.0, "ttft_s": 9.0}]}
    # (1.0 + 1.5) s over (10 + 30) gaps between tokens
    assert client_side(run) == {"client_tpot_p50_ms": 30.0, "client_token_weighted_ms": 62.5,
                                "client_ttft_p50_ms": 120.0}
    # with prompt lengths: TTFT = 20 ms + 30 ms per 1k prompt tokens, exactly
    run["requests"] = [{"success": True, "output_tokens": 5, "e2e_s": 1.0, "prompt_tokens": n,
                        "ttft_s": (20 + 0.03 * n) / 1e3} for n in (100, 1000, 4000)]
    fit = client_side(run)
    assert (fit["client_ttft_fixed_ms"], fit["client_ttft_ms_per_1k_prompt"]) == (20.0, 30.0)


def test_prefill_rate_by_sms_and_switches_by_reason(tmp_path):
    """plot_steps' prefill side beside a busy decode (by its SMs) and the split switches grouped by what decided
    them, on hand-made records."""
    from benchmarks.plot_steps import prefill_rate_by_sms, records, switches_by_reason

    def step(sms, busy, tokens, ms):
        return {"kind": "step", "side": "prefill", "prefill_sms": sms, "other_busy": busy, "num_tokens": tokens,
                "measured_ms": ms}

    steps = [step(100, True, 2000, 100.0), step(100, True, 3000, 100.0), step(100, True, 4000, 100.0),
             step(100, False, 2000, 10.0),  # decode idle: left out
             step(116, True, 1000, 10.0),  # too small: left out
             step(116, True, 2900, 100.0)]
    assert prefill_rate_by_sms(steps) == {100: {"steps": 3, "tokens_per_s_p50": 30000.0},
                                          116: {"steps": 1, "tokens_per_s_p50": 29000.0}}
    assert prefill_rate_by_sms(steps, other_busy=False) == {100: {"steps": 1, "tokens_per_s_p50": 200000.0}}
    log = tmp_path / "log.jsonl"
    rows = [{"kind": "decision", "t": 1.0, "reason": "to_decode", "switch": True},
            {"kind": "switch", "t": 1.1, "decision_to_split_us": 100_000, "acked_last": "decode"},
            {"kind": "decision", "t": 2.0, "reason": "balance", "switch": False},  # no switch: keeps to_decode
            {"kind": "switch", "t": 2.1, "decision_to_split_us": 300_000, "acked_last": "decode"},
            {"kind": "decision", "t": 3.0, "reason": "to_prefill", "switch": True},
            {"kind": "switch", "t": 3.1, "decision_to_split_us": 20_000, "acked_last": "prefill"}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert switches_by_reason(records(str(log))) == {
        ("to_decode", "decode"): {"switches": 2, "p50_ms": 200.0, "max_ms": 300.0},
        ("to_prefill", "prefill"): {"switches": 1, "p50_ms": 20.0, "max_ms": 20.0}}


def test_launch_parts_by_how_the_forward_ran(tmp_path):
    from benchmarks.plot_launch import parts_by_graphs

    log = tmp_path / "log.jsonl"
    rows = [{"kind": "step", "graphs": "piecewise", "prep_ms": p, "attention_ms": a, "launch_ms": 3 * a,
             "measured_ms": 30.0} for p, a in ((1.0, 2.0), (2.0, 4.0), (3.0, 6.0))]
    rows += [{"kind": "step", "graphs": "decode", "prep_ms": 0.5, "launch_ms": 1.5, "measured_ms": 8.0},
             {"kind": "decision", "t": 0.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert parts_by_graphs(str(log)) == {
        "decode": {"steps": 1, "prep_ms": 0.5, "launch_ms": 1.5, "measured_ms": 8.0},
        "piecewise": {"steps": 3, "prep_ms": 2.0, "attention_ms": 4.0, "launch_ms": 12.0, "measured_ms": 30.0}}


def test_decode_only_steps_by_how_the_forward_ran(tmp_path):
    """plot_launch: steps without prompt tokens (a decode batch above the largest decode graph runs piecewise)."""
    from benchmarks.plot_launch import decode_only_by_graphs

    log = tmp_path / "log.jsonl"
    rows = [{"kind": "step", "graphs": "piecewise", "num_prefill_seqs": 0, "num_seqs": n, "num_context_tokens": 1000 * n,
             "measured_ms": ms} for n, ms in ((300, 40.0), (320, 44.0), (360, 50.0))]
    rows += [{"kind": "step", "graphs": "piecewise", "num_prefill_seqs": 2, "num_seqs": 40, "num_context_tokens": 9,
              "measured_ms": 90.0},  # prompt tokens: left out
             {"kind": "step", "graphs": "decode", "num_prefill_seqs": 0, "num_seqs": 4, "num_context_tokens": 5000,
              "measured_ms": 7.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert decode_only_by_graphs(str(log)) == {
        "decode": {"steps": 1, "num_seqs": 4, "num_context_tokens": 5000, "measured_ms": 7.0},
        "piecewise": {"steps": 3, "num_seqs": 320, "num_context_tokens": 320000, "measured_ms": 44.0}}


def test_blocked_launches_count_the_launches_that_waited_for_the_gpu(tmp_path):
    """plot_launch: a launch holding the host for most of its own step's device time waited for the GPU inside;
    the longest part names where (the sample's parts where the log splits it), the same side's next step's host
    time before its forward is what the GPU may have idled; layer-wise steps wait between groups by design."""
    from benchmarks.plot_launch import blocked_launches

    log = tmp_path / "log.jsonl"
    rows = [{"kind": "step", "t": 1.0, "side": "prefill", "phase": "prefill", "launch_ms": 15.0,
             "measured_ms": 400.0, "prep_ms": 9.0},
            {"kind": "step", "t": 2.0, "side": "prefill", "phase": "prefill", "launch_ms": 810.0,
             "measured_ms": 420.0, "prep_ms": 7.0, "forward_ms": 2.0, "sample_ms": 800.0},
            {"kind": "step", "t": 2.5, "side": "decode", "phase": "decode", "launch_ms": 2.0, "measured_ms": 9.0,
             "prep_ms": 50.0, "gap_ms": 50.0},  # the other side's: not the next step of this one
            {"kind": "step", "t": 3.0, "side": "prefill", "phase": "prefill", "launch_ms": 60.0, "measured_ms": 31.0,
             "prep_ms": 7.0, "forward_ms": 1.0, "sample_ms": 51.0, "sample_rows_ms": 0.1, "logits_ms": 50.0,
             "sampler_ms": 0.3, "to_host_ms": 0.2, "gap_ms": 1.5},
            {"kind": "step", "t": 3.5, "side": "prefill", "phase": "prefill", "launch_ms": 500.0, "measured_ms": 90.0,
             "prep_ms": 2.0, "forward_ms": 495.0, "layer_groups": 4},  # waits between its groups: left out
            {"kind": "step", "t": 4.0, "side": "prefill", "phase": "mixed", "launch_ms": 70.0, "measured_ms": 60.0,
             "prep_ms": 1.0, "forward_ms": 65.0, "gap_ms": 2.0, "attn_plan_ms": 0.5},
            {"kind": "decision", "t": 2.5}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert blocked_launches(str(log)) == {"steps": 5, "blocked": 3, "by_phase": {"prefill": 2, "mixed": 1},
                                          "longest_part": {"sample_ms": 1, "logits_ms": 1, "forward_ms": 1},
                                          "next_host_ms_sum": (1.5 + 7.0) + (2.0 + 1.0 + 0.5)}


def test_switch_summary_gives_ack_and_drain_percentiles(tmp_path):
    """plot_steps.switch_summary (what serve_h100 saves per bullet system): counts and p50 / p99 of the
    decision-to-ack and decision-to-drained times; None for a log without switches."""
    from benchmarks.plot_steps import records, switch_summary

    log = tmp_path / "log.jsonl"
    rows = [{"kind": "switch", "t": float(i), "decision_to_split_us": 1000 * (i + 1), "acked_last": "decode"}
            for i in range(4)]
    rows += [{"kind": "switch_drained", "t": i + 0.5, "decision_to_drained_us": 10_000 * (i + 1)} for i in range(3)]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert switch_summary(records(str(log))) == {"acked": 4, "acked_p50_ms": 3.0, "acked_p99_ms": 4.0, "drained": 3,
                                        "drained_p50_ms": 20.0, "drained_p99_ms": 30.0}
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "step", "t": 0.0}) + "\n")
    assert switch_summary(records(str(empty))) is None


def test_acked_sites_count_where_the_last_side_acked_each_switch():
    """plot_steps.acked_sites: switches per `site` of their record (a record without one: `-`), most first; other
    records are not counted."""
    from benchmarks.plot_steps import acked_sites

    recs = [{"kind": "switch", "site": s} for s in ("piece", "sample", "piece", "prep", None)]
    recs += [{"kind": "switch_drained", "site": "piece"}, {"kind": "step"}]
    assert acked_sites(recs) == {"piece": 2, "sample": 1, "prep": 1, "-": 1}
    assert list(acked_sites(recs))[0] == "piece" and acked_sites([]) == {}


def test_handoff_summary_splits_the_hops_by_the_way_they_came(tmp_path):
    """plot_steps.handoff_summary (serve_h100's extra.handoffs): per way, count and p50 / p90 / p99 of the decode
    worker's `handoff` records; {} for a log without any."""
    from benchmarks.plot_steps import handoff_summary, records

    log = tmp_path / "log.jsonl"
    rows = [{"kind": "handoff", "t": float(i), "via": "direct", "hop_ms": float(i + 1)} for i in range(10)]
    rows += [{"kind": "handoff", "t": 0.0, "via": "front", "hop_ms": 7.5}, {"kind": "step", "t": 0.0}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert handoff_summary(records(str(log))) == {
        "direct": {"handoffs": 10, "p50_ms": 6.0, "p90_ms": 10.0, "p99_ms": 10.0},
        "front": {"handoffs": 1, "p50_ms": 7.5, "p90_ms": 7.5, "p99_ms": 7.5}}
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"kind": "step", "t": 0.0}) + "\n")
    assert handoff_summary(records(str(empty))) == {}


def test_drain_idle_counts_the_sms_prefill_gained_while_its_old_step_ran(tmp_path):
    """plot_steps.drain_idle: a switch that grows prefill (entry 1 -> 0: 108 -> 116 prefill SMs) drained last by
    prefill idles the 8 SMs it gained from the acks (5 ms) to the drain (25 ms); one that shrinks prefill, or one
    that decode drained last, costs nothing here."""
    from benchmarks.plot_steps import drain_idle, records

    log = tmp_path / "log.jsonl"
    step = {"kind": "step", "side": "decode", "num_tokens": 1}
    rows = [{**step, "t": 0.0, "split_index": 1, "decode_sms": 24, "prefill_sms": 108},
            {"kind": "switch", "t": 0.1, "index": 1, "decision_to_split_us": 1000},
            {"kind": "switch_drained", "t": 0.2, "index": 1, "decision_to_drained_us": 2000, "drained_last": "decode"},
            {"kind": "switch", "t": 0.3, "index": 0, "decision_to_split_us": 5000},
            {"kind": "switch_drained", "t": 0.4, "index": 0, "decision_to_drained_us": 25000, "drained_last": "prefill"},
            {"kind": "switch", "t": 0.5, "index": 1, "decision_to_split_us": 3000},
            {"kind": "switch_drained", "t": 0.6, "index": 1, "decision_to_drained_us": 90000, "drained_last": "prefill"},
            {**step, "t": 1.0, "split_index": 0, "decode_sms": 16, "prefill_sms": 116}]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert drain_idle(records(str(log))) == {"switches": 1, "idle_sm_ms": 8 * 20.0, "share": round(160.0 / (1000 * 132), 6)}


def test_prefill_gemm_summary_counts_what_the_tuning_kept_by_partition(tmp_path):
    """plot_steps.prefill_gemm_summary (serve_h100's extra.prefill_gemm): the report without its points, and per
    partition size the points kept and their median speedup; {} for a log without the report."""
    from benchmarks.plot_steps import prefill_gemm_summary, records

    def point(sms, algo, base_ms, ms):
        return {"sms": sms, "algo": algo, "base_ms": base_ms, "ms": ms}
    report = {"gemm": "cublaslt", "points": 4, "kept": 3, "choices": [
        point(116, "ab", 3.0, 2.0), point(116, "cd", 2.0, 1.6), point(116, None, 1.0, 1.0), point(84, "ef", 2.2, 2.0)]}
    log = tmp_path / "steps.jsonl"
    log.write_text(json.dumps({"kind": "startup", "role": "decode", "seconds": {}}) + "\n"
                   + json.dumps({"kind": "startup", "role": "prefill", "seconds": {}, "prefill_gemm": report}) + "\n")
    assert prefill_gemm_summary(records(str(log))) == {"gemm": "cublaslt", "points": 4, "kept": 3, "by_sms": {
        116: {"points": 3, "kept": 2, "median_speedup": 1.5}, 84: {"points": 1, "kept": 1, "median_speedup": 1.1}}}
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"kind": "startup", "role": "prefill", "seconds": {}}) + "\n")
    assert prefill_gemm_summary(records(str(plain))) == {}


def test_startup_summary_reads_each_workers_startup_record(tmp_path):
    """plot_steps.startup_summary (serve_h100's extra.startup): seconds by part, by role; {} without records."""
    from benchmarks.plot_steps import records, startup_summary

    log = tmp_path / "steps.jsonl"
    # prefill starts at t = 100, sends its handles at 109 and ends at 160; decode, started at 110, ends at 170
    rows = [{"kind": "startup", "t": 160.0, "role": "prefill", "seconds": {"resources": 9.0, "total": 60.0},
             "handles_after_s": 9.0},
            {"kind": "startup", "t": 170.0, "role": "decode", "seconds": {"resources": 1.0, "decode_graphs": 40.0,
                                                                          "total": 60.0}},
            {"kind": "step", "t": 171.0, "side": "prefill"}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert startup_summary(records(str(log))) == {
        "prefill": {"resources": 9.0, "total": 60.0, "handles_after_s": 9.0, "done_after_s": 60.0},
        "decode": {"resources": 1.0, "decode_graphs": 40.0, "total": 60.0, "done_after_s": 70.0}}
    # a restart whose decode record was lost: the old decode record began before the new start, so it gets no offset
    restarted = tmp_path / "restarted.jsonl"
    again = {"kind": "startup", "t": 1160.0, "role": "prefill", "seconds": {"resources": 9.0, "total": 60.0}}
    restarted.write_text("\n".join(json.dumps(r) for r in rows[:2] + [again]) + "\n")
    summary = startup_summary(records(str(restarted)))
    assert summary["prefill"]["done_after_s"] == 60.0 and "done_after_s" not in summary["decode"]
    empty = tmp_path / "none.jsonl"
    empty.write_text(json.dumps(rows[2]) + "\n")
    assert startup_summary(records(str(empty))) == {}


def test_balance_streaks_group_consecutive_balance_decisions_with_their_decode_steps():
    """plot_steps.balance_streaks: logged BALANCE decisions close together, broken by another logged decision or a
    gap, each with the decode steps taken meanwhile (SMs, batch, step times)."""
    from benchmarks.plot_steps import balance_streaks

    decisions = [{"t": t, "reason": r} for t, r in ((1.0, "balance"), (1.2, "balance"), (1.4, "balance_tpot"),
                                                    (1.5, "backlog"), (1.6, "balance"), (3.0, "balance"))]
    steps = [{"t": t, "side": "decode", "decode_sms": sms, "num_seqs": n, "measured_ms": ms}
             for t, sms, n, ms in ((1.1, 16, 40, 30.0), (1.3, 24, 44, 26.5), (2.0, 32, 50, 20.0))]
    assert balance_streaks(decisions, steps) == [
        {"t_start": 1.0, "t_end": 1.4, "decisions": 3, "decode_sms": [16, 24], "decode_seqs": (40, 44),
         "decode_step_ms": (26.5, 30.0)},
        {"t_start": 1.6, "t_end": 1.6, "decisions": 1, "decode_sms": [], "decode_seqs": (0, 0), "decode_step_ms": None},
        {"t_start": 3.0, "t_end": 3.0, "decisions": 1, "decode_sms": [], "decode_seqs": (0, 0), "decode_step_ms": None}]


def test_plot_steps_counts_steps_that_moved_while_launching():
    """plot_steps counts, per side, the steps the log marks `moved_while_launching` (layer groups, decode pieces)."""
    from benchmarks.plot_steps import moved_while_launching

    steps = [{"side": "decode", "moved_while_launching": True, "runs_on": 3}, {"side": "decode"},
             {"side": "prefill", "moved_while_launching": True, "runs_on": 1}, {"side": "decode",
                                                                                 "moved_while_launching": True}]
    assert moved_while_launching(steps) == {"decode": 2, "prefill": 1}
    assert moved_while_launching([{"side": "decode"}]) == {}


def test_plot_steps_sets_first_graph_uses_against_the_rest():
    """plot_steps takes the first decode step of each (split, graph bucket, split moved to) apart from the rest:
    30 and 31 sequences share bucket 32, a move to another split is a new key, eager steps are left out."""
    from benchmarks.plot_steps import first_replays

    def step(seqs, split, over, runs_on=None, graphs="decode"):
        return {"side": "decode", "graphs": graphs, "num_seqs": seqs, "split_index": split, "runs_on": runs_on,
                "predicted_ms": 10.0, "measured_ms": 10.0 + over}

    steps = [step(30, 0, 8.0), step(31, 0, 1.0), step(30, 0, 2.0), step(30, 1, 4.0), step(30, 0, 50.0, runs_on=1),
             step(30, 0, 99.0, graphs="eager"), {"side": "prefill", "graphs": "piecewise"}]
    assert first_replays(steps) == {"first": 3, "first_p50_ms": 8.0, "first_max_ms": 50.0, "rest": 2,
                                    "rest_p99_ms": 2.0}
    assert first_replays(steps[:1]) is None  # no rest to set them against


def test_step_log_marks_decode_steps_whose_wait_for_a_piece_was_cut():
    """A launch records the waits for a decode piece that a requested split cut short (`piece_waits_cut`, only where
    there were some), and plot_steps counts the steps and the waits."""
    from benchmarks.plot_steps import piece_waits_cut
    from bullet_ray.engine.runner import InFlightStep

    step = InFlightStep([], [], None, None, None, 4, 40)
    assert "piece_waits_cut" not in step.log_fields()
    step.piece_waits_cut = 2
    assert step.log_fields()["piece_waits_cut"] == 2
    assert "moved_at_piece" not in step.log_fields()  # the boundary where it moved, only for a step that did
    step.moved_at_piece = 3
    assert step.log_fields()["moved_at_piece"] == 3
    assert "piece_poll_gap_ms" not in step.log_fields()
    step.piece_poll_gap_s = 0.0012
    assert step.log_fields()["piece_poll_gap_ms"] == 1.2
    from benchmarks.plot_steps import poll_gaps

    assert poll_gaps([{"side": "decode"}]) is None
    assert poll_gaps([{"side": "decode", "piece_poll_gap_ms": g} for g in (0.1, 0.3, 2.0)]) == (3, 0.3, 2.0, 2.0)
    steps = [{"side": "decode", "piece_waits_cut": 2}, {"side": "decode"}, {"side": "decode", "piece_waits_cut": 1},
             {"side": "prefill"}]
    assert piece_waits_cut(steps) == (2, 3)
    assert piece_waits_cut([]) == (0, 0)


def test_plot_steps_decode_step_medians_by_sms_and_bucket():
    """Decode steps on graphs grouped by (decode SMs, graph bucket): 30 and 31 sequences share bucket 32; eager steps
    and cells under `min_steps` are left out."""
    from benchmarks.plot_steps import decode_step_medians

    def step(seqs, sms, measured, graphs="decode"):
        return {"side": "decode", "graphs": graphs, "num_seqs": seqs, "decode_sms": sms, "predicted_ms": 10.0,
                "measured_ms": measured}

    steps = [step(30, 16, 9.0), step(31, 16, 11.0), step(32, 16, 12.0), step(30, 24, 5.0), step(30, 16, 99.0, "eager")]
    assert decode_step_medians(steps, min_steps=2) == {(16, 32): {"steps": 3, "measured_ms": 11.0,
                                                                  "predicted_ms": 10.0}}


def test_plot_steps_places_each_slow_switch_against_the_decode_steps():
    """A switch acked last by decode over 1 ms is placed where its decision found the decode side: inside a step
    that then moved, inside one that did not (the next step took the split: its host preparation shown), or between
    steps; faster switches and those the prefill side acked last are left out."""
    from benchmarks.plot_steps import prep_quantiles, slow_switches

    def step(t, ms, seqs, prep, moved=False):
        rec = {"kind": "step", "side": "decode", "t": t, "measured_ms": ms, "num_seqs": seqs, "prep_ms": prep}
        return {**rec, "moved_while_launching": True} if moved else rec

    def switch(t, us, last="decode", **where):
        return {"kind": "switch", "t": t, "decision_to_split_us": us, "acked_last": last, **where}

    recs = [step(10.020, 20.0, 100, 0.8), step(10.040, 20.0, 100, 0.9, moved=True), step(10.060, 20.0, 110, 0.7),
            {**step(10.100, 20.0, 50, 0.3), "graph_setup_ms": 2.2, "graph_plan_ms": 2.0, "graph_wait_ms": 1.9},
            switch(10.0375, 1500),           # decided at 10.036, inside the second step, which moved
            switch(10.0595, 1500),           # decided at 10.058, inside the third, which did not: the fourth took it
            switch(10.0705, 2000, site="loop", inflight=False, since_collect_ms=10.2),  # decided at 10.0685:
                                             # between the third and the fourth; where decode acked, logged
            switch(10.0302, 500),            # under 1 ms
            switch(10.0903, 3000, "prefill")]
    rows = slow_switches(recs)
    assert [r["where"] for r in rows] == ["moved in its step", "next step", "between steps"]
    assert rows[0]["step_seqs"] == 100 and rows[0]["ms_to_collect"] == 4.0
    assert rows[1]["step_seqs"] == 110 and rows[1]["next_prep_ms"] == 0.3 and not rows[1]["next_moved"]
    assert rows[1]["next_plan_ms"] is None  # the fake steps log no planning time
    # the fourth's host time before its first graph replay, the plan's part and the waits for the GPU in it
    assert (rows[1]["next_graph_setup_ms"], rows[1]["next_graph_plan_ms"], rows[1]["next_graph_wait_ms"]) == (2.2, 2.0, 1.9)
    assert rows[0]["next_graph_wait_ms"] is None  # the third's log has none
    assert "step_seqs" not in rows[2] and rows[2]["next_prep_ms"] == 0.3
    assert rows[0]["site"] is None  # logs before the ack site was recorded
    assert (rows[2]["site"], rows[2]["inflight"], rows[2]["since_collect_ms"]) == ("loop", False, 10.2)
    count, p50, p90 = prep_quantiles([r for r in recs if r["kind"] == "step"], min_seqs=100)  # 0.7, 0.8, 0.9 (_q: nearest rank)
    assert count == 3 and p50 == pytest.approx(0.8) and p90 == pytest.approx(0.9)
    assert prep_quantiles([], 1) is None


def test_plot_steps_sums_the_garbage_collections_per_side_and_names_them_on_a_slow_switch():
    """`gc_summary`: per side, the steps whose records carry collections (`gc_ms`, `gc_count`, `gc_gen`), their
    total and largest time and those reaching the oldest generation; a slow switch carries the acking process's
    collection time inside its latency (`gc_ms`)."""
    from benchmarks.plot_steps import gc_summary, slow_switches

    steps = [{"kind": "step", "side": "decode", "t": 1.0, "measured_ms": 5.0, "num_seqs": 8, "gc_ms": 0.1,
              "gc_count": 1, "gc_gen": 0},
             {"kind": "step", "side": "decode", "t": 1.01, "measured_ms": 5.0, "num_seqs": 8, "gc_ms": 1.5,
              "gc_count": 2, "gc_gen": 2},
             {"kind": "step", "side": "decode", "t": 1.02, "measured_ms": 5.0, "num_seqs": 8},
             {"kind": "step", "side": "prefill", "t": 1.0, "measured_ms": 50.0, "num_seqs": 1}]
    assert gc_summary(steps) == {"decode": {"steps": 2, "collections": 3, "total_ms": 1.6, "max_ms": 1.5,
                                            "max_seqs": 8, "p99_ms": 1.5, "oldest_gen_steps": 1}}
    assert gc_summary(steps[2:]) == {}
    switch = {"kind": "switch", "t": 1.0125, "decision_to_split_us": 2000, "acked_last": "decode", "gc_ms": 1.2,
              "launch_began_ms": 0.8, "launch_ended_ms": 12.5}
    (row,) = slow_switches([*steps, switch])
    assert (row["gc_ms"], row["launch_began_ms"], row["launch_ended_ms"]) == (1.2, 0.8, 12.5)


def test_plot_steps_names_the_part_of_a_decode_launch_a_decision_fell_in():
    """`launch_phase`: the decode step whose launch began last before the decision (`launch_began_t`) and which of
    its host parts, laid end to end (preparation, graph set-up, the rest of the forward, the sampling launch), held
    the decode host then; past them, after the launch. A slow switch's row carries it."""
    from benchmarks.plot_steps import launch_phase, slow_switches

    def step(t, began, **host):
        return {"kind": "step", "side": "decode", "t": t, "measured_ms": 20.0, "num_seqs": 90,
                "launch_began_t": began, **host}

    steps = [step(10.030, 10.000, prep_ms=0.5, graph_setup_ms=1.5, forward_ms=15.0, sample_ms=1.0),
             step(10.050, 10.020, prep_ms=0.6, forward_ms=12.0, sample_ms=0.8),  # no graph set-up logged (eager)
             {"kind": "step", "side": "decode", "t": 9.9, "measured_ms": 5.0, "num_seqs": 4}]  # an older log's row
    assert launch_phase(steps, 9.999) is None  # before any launch the log places
    assert launch_phase(steps, 10.0003)["phase"] == "preparation"
    setup = launch_phase(steps, 10.0012)  # 1.2 ms in: 0.7 ms into the 1.5 ms set-up
    assert setup == {"phase": "graph set-up", "into_ms": pytest.approx(1.2), "phase_ms": 1.5,
                     "since_phase_ms": pytest.approx(0.7), "seqs": 90}
    assert launch_phase(steps, 10.005)["phase"] == "forward"
    sampling = launch_phase(steps, 10.0156)  # the forward ends at 0.5 + 15.0
    assert (sampling["phase"], sampling["since_phase_ms"]) == ("sampling launch", pytest.approx(0.1))
    after = launch_phase(steps, 10.0170)
    assert (after["phase"], after["phase_ms"], after["since_phase_ms"]) == ("after the launch", None,
                                                                            pytest.approx(0.5))
    assert launch_phase(steps, 10.0207)["phase"] == "forward"  # the second step's launch (no set-up part)
    switch = {"kind": "switch", "t": 10.0176, "decision_to_split_us": 2000, "acked_last": "decode"}
    (row,) = slow_switches([*steps, switch])  # decided at 10.0156: the first step's sampling launch
    assert row["launch_phase"]["phase"] == "sampling launch"
