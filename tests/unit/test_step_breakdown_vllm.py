"""step_breakdown --peers vllm: our step log's steps beside vLLM's engine-side figures, on hand-made rows."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.step_breakdown import (
    gap_split,
    gaps_table,
    main,
    paired_tpot,
    per_rate,
    side_by_side,
    vllm_engine_side,
)
from benchmarks.vllm_metrics import steps_by_tokens


def _step(t: float, phase: str, tokens: int, seqs: int, prefill_seqs: int, ms: float) -> dict:
    return {"kind": "step", "t": t, "side": "hybrid", "phase": phase, "num_tokens": tokens, "num_seqs": seqs,
            "num_prefill_seqs": prefill_seqs, "measured_ms": ms}


STEPS = [_step(99.0, "prefill", 500, 1, 1, 30.0),  # before the run: left out
         _step(100.1, "prefill", 2048, 3, 2, 80.0), _step(100.2, "mixed", 700, 5, 1, 40.0),
         _step(100.3, "decode", 5, 5, 0, 10.0), _step(100.4, "decode", 5, 5, 0, 10.0),
         _step(100.5, "decode", 4, 4, 0, 10.0)]
RUN = {"environment": {"started_unix_s": 100.0}, "summary": {"duration_s": 1.0, "tpot_ms": {"p50": 11.0},
                                                             "ttft_ms": {"p50": 90.0}},
       "requests": [{"success": True, "output_tokens": 3, "e2e_s": 0.3, "ttft_s": 0.1}]}
VLLM_FOUND = {"url": "http://x/metrics",
              "steps": {"num_steps": 100, "num_tokens": 12000, "tokens_per_step_mean": 120.0,
                        "steps_by_tokens": {"<=1": 0, "9-16": 20, "17-32": 50, "513-1024": 30}},
              "counters": {"num_preemptions": 2, "prompt_tokens": 7000, "generation_tokens": 5000,
                           "num_requests_finished": 40},
              "time_ms": {"queue": {"count": 40, "mean_ms": 50.0}, "prefill": {"count": 40, "mean_ms": 100.0},
                          "decode": {"count": 40, "mean_ms": 2000.0}, "itl": None},
              "missing": []}


def test_our_steps_per_rate_in_vllms_token_ranges():
    figures = per_rate(STEPS, RUN)
    assert (figures["steps"], figures["decode_steps"], figures["prompt_steps"]) == (5, 3, 2)
    assert figures["tokens_per_step_mean"] == round((2048 + 700 + 5 + 5 + 4) / 5, 1)  # 552.4
    assert figures["prompt_step_tokens_mean"] == 1374.0
    assert (figures["run_s"], figures["ms_per_step"]) == (1.0, 200.0)  # the run's 1 s over its 5 steps
    assert figures["steps_by_tokens"]["2-8"] == 3 and figures["steps_by_tokens"]["513-1024"] == 1
    assert figures["steps_by_tokens"]["1025-2048"] == 1 and sum(figures["steps_by_tokens"].values()) == 5
    assert steps_by_tokens([1, 0, 2, 8, 9, 16385])["<=1"] == 2
    assert steps_by_tokens([1, 0, 2, 8, 9, 16385])["16385+"] == 1


def test_vllm_engine_side_from_a_run():
    assert vllm_engine_side({"requests": []}) is None
    assert vllm_engine_side({"probes": {"vllm_metrics": {"error": "start: URLError: refused"}}}) == \
        {"error": "start: URLError: refused"}
    assert vllm_engine_side({**RUN, "probes": {"vllm_metrics": VLLM_FOUND}}) == {
        "steps": 100, "run_s": 1.0, "ms_per_step": 10.0, "tokens_per_step_mean": 120.0, "steps_by_tokens": VLLM_FOUND["steps"]["steps_by_tokens"],
        "preemptions": 2, "queue_ms_mean": 50.0, "prefill_ms_mean": 100.0, "decode_ms_mean": 2000.0}


def test_main_prints_both_sides(tmp_path: Path, capsys):
    log = tmp_path / "chunked-2048-steps.jsonl"
    log.write_text("".join(json.dumps(s) + "\n" for s in STEPS))
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "chunked-2048-rate24.json").write_text(json.dumps(RUN))
    (runs / "vllm-rate24.json").write_text(json.dumps({**RUN, "probes": {"vllm_metrics": VLLM_FOUND}}))
    out = tmp_path / "breakdown.json"
    assert main([str(log), "--runs", str(runs), "--system", "chunked-2048", "--rates", "24", "--peers", "vllm",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["peers"]["vllm"]["24"]["engine"]["steps"] == 100
    assert result["peers"]["vllm"]["24"]["client_ttft_p50_ms"] == 90.0
    table = side_by_side(result)
    assert table in capsys.readouterr().out
    rows = table.splitlines()[2:]
    assert rows[0] == ("| 24 | chunked-2048 | 5 | 3 / 2 | 552.4 | 1374.0 | 2-8:3 513-1024:1 1025-2048:1 | - | - |")
    assert rows[1] == "| 24 | vllm | 100 | - | 120.0 | - | 9-16:20 17-32:50 513-1024:30 | 2 | 50.0 / 100.0 / 2000.0 |"


def test_first_token_records_split_the_engines_ttft():
    first = [{"kind": "first_token", "t": 100.2 + i / 10, "to_worker_ms": 1.0 + i, "queue_ms": 10.0 * i,
              "prefill_ms": 30.0, "worker_ttft_ms": 31.0 + 11.0 * i} for i in range(3)]
    first.append({**first[0], "t": 99.0})  # before the run: left out
    figures = per_rate(STEPS, RUN, first)
    assert figures["first_tokens"] == 3
    assert (figures["engine_to_worker_ms_p50"], figures["engine_queue_ms_p50"]) == (2.0, 10.0)
    assert (figures["engine_prefill_ms_p50"], figures["engine_worker_ttft_ms_p50"]) == (30.0, 42.0)
    assert figures["client_minus_engine_ttft_p50_ms"] == 90.0 - 42.0
    assert "first_tokens" not in per_rate(STEPS, RUN)  # logs written before the records existed


def test_plot_steps_reads_a_runs_first_tokens(tmp_path: Path):
    from benchmarks.plot_steps import first_tokens_of_run, records

    log = tmp_path / "steps.jsonl"
    rows = [{"kind": "first_token", "t": 100.5, "to_worker_ms": 40.0, "queue_ms": 1.0, "prefill_ms": 130.0,
             "worker_ttft_ms": 171.0}, {"kind": "first_token", "t": 102.0, "to_worker_ms": 1.0, "queue_ms": 1.0,
                                        "prefill_ms": 1.0, "worker_ttft_ms": 3.0}]  # after the run: left out
    log.write_text("".join(json.dumps(r) + "\n" for r in [*STEPS, *rows]))
    parts = first_tokens_of_run(records(str(log)), RUN)
    assert parts["first_tokens"] == 1 and parts["engine_to_worker_ms_p50"] == 40.0
    assert parts["client_minus_engine_ttft_p50_ms"] == 90.0 - 171.0


def test_gaps_between_tokens_split_at_the_long_gap():
    requests = [{"success": True, "output_tokens": 4, "itl_s": [0.010, 0.012, 0.050]},
                {"success": True, "output_tokens": 3, "itl_s": [0.008, 0.040]},
                {"success": True, "output_tokens": 2}]  # no gaps recorded: counted nowhere
    assert gap_split(requests, 30.0) == {"gaps_short": 3, "gap_short_mean_ms": 10.0, "gaps_long": 2,
                                         "gaps_long_sum_s": 0.09}
    assert gap_split(requests, 60.0)["gaps_long"] == 0
    assert gap_split([{"success": True, "output_tokens": 1}], 30.0) == {}


def _req(index: int, tpot_s: float | None, prompt: int = 100, success: bool = True) -> dict:
    return {"index": index, "success": success, "tpot_s": tpot_s, "prompt_tokens_requested": prompt,
            "output_tokens_requested": 10}


def test_peer_tpot_paired_request_by_request():
    ours = {"requests": [_req(i, 0.020) for i in range(11)] + [_req(11, 0.020)]}
    # the peer is 10% faster on every request but two: one failed, one without a TPOT; request 99 is not ours
    peer = {"requests": [_req(i, 0.018) for i in range(10)] + [_req(10, 0.5, success=False), _req(11, None),
                                                                 _req(99, 0.001)]}
    paired = paired_tpot(ours, peer)
    assert paired == {"pairs": 10, "tpot_ratio_p10": 0.9, "tpot_ratio_p50": 0.9, "tpot_ratio_p90": 0.9}
    spread = paired_tpot(ours, {"requests": [_req(i, 0.002 * (i + 1)) for i in range(10)]})
    assert spread["tpot_ratio_p50"] == 0.55 and spread["tpot_ratio_p10"] < spread["tpot_ratio_p90"]
    # another workload (a prompt length differs at an index): no pairing
    assert paired_tpot(ours, {"requests": [_req(0, 0.02, prompt=101)]}) is None
    assert paired_tpot(ours, {"requests": []}) is None


def test_gaps_table_sets_peers_beside_ours():
    result = {"system": "chunked", "rates": {"24": {"gaps_short": 5, "gap_short_mean_ms": 10.0, "gaps_long": 2,
                                                       "gaps_long_sum_s": 0.1}},
              "peers": {"vllm": {"24": {"gaps_short": 6, "gap_short_mean_ms": 10.5, "gaps_long": 1,
                                        "gaps_long_sum_s": 0.07,
                                        "paired": {"pairs": 3, "tpot_ratio_p10": 0.9, "tpot_ratio_p50": 0.95,
                                                   "tpot_ratio_p90": 1.0}}}}}
    rows = gaps_table(result).splitlines()[2:]
    assert rows == ["| 24 | chunked | 5 / 10.0 | 2 / 0.1 | - |", "| 24 | vllm | 6 / 10.5 | 1 / 0.07 | 0.9 / 0.95 / 1.0 |"]
