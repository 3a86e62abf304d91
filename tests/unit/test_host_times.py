"""benchmarks.host_times on hand-made step records: host-time medians by kind and batch bin, the decode-acked
switches placed against the decode step then on the GPU, and one-line errors for bad arguments."""

from __future__ import annotations

import json

import pytest

from benchmarks.host_times import decode_acks, host_times, main, parse_bins


def _step(t, side, seqs, tokens, prep, plan, measured=10.0, phase=None):
    return {"kind": "step", "t": t, "side": side, "num_seqs": seqs, "num_tokens": tokens, "prep_ms": prep,
            "plan_ms": plan, "measured_ms": measured, "phase": phase or ("decode" if tokens == seqs else "mixed")}


def test_parse_bins_reads_ranges_and_names_a_bad_one():
    assert parse_bins("1-16,17-48") == [(1, 16), (17, 48)]
    with pytest.raises(ValueError, match="bin '16': want LOW-HIGH"):
        parse_bins("1-8,16")
    with pytest.raises(ValueError, match="bin '9-2'"):
        parse_bins("9-2")


def test_host_times_splits_decode_from_mixed_and_leaves_prefill_out():
    recs = [_step(0, "decode", 4, 4, 0.1, 0.01), _step(1, "decode", 8, 8, 0.3, 0.03),
            _step(2, "hybrid", 20, 20, 0.5, 0.05), _step(3, "hybrid", 20, 2068, 1.5, 0.2),
            _step(4, "hybrid", 1, 536, 0.4, 0.1, phase="prefill"),  # a whole prompt alone: neither kind
            _step(5, "prefill", 3, 900, 2.0, 1.0), {"kind": "decision", "t": 6}]
    recs[0]["forward_ms"], recs[1]["forward_ms"] = 0.4, 0.6  # the forward launch where a log has it
    recs[0]["graph_wait_ms"], recs[1]["graph_wait_ms"] = 0.0, 1.8  # and the graph set-up's wait for the GPU
    recs[0]["graph_plan_ms"], recs[1]["graph_plan_ms"] = 0.2, 1.0  # the attention plan inside it
    recs[1]["sample_ms"] = recs[2]["sample_ms"] = 0.7  # the sampling launch
    rows = host_times(recs, [(1, 16), (17, 48)])
    none = {"forward_ms_p50": None, "graph_plan_ms_p50": None, "graph_wait_ms_max": None}
    assert rows == [{"kind": "decode", "seqs": "1-16", "steps": 2, "plan_ms_p50": 0.02, "prep_ms_p50": 0.2,
                     "forward_ms_p50": 0.5, "graph_plan_ms_p50": 0.6, "sample_ms_p50": 0.7, "graph_wait_ms_max": 1.8},
                    {"kind": "decode", "seqs": "17-48", "steps": 1, "plan_ms_p50": 0.05, "prep_ms_p50": 0.5,
                     **none, "sample_ms_p50": 0.7},
                    {"kind": "mixed", "seqs": "17-48", "steps": 1, "plan_ms_p50": 0.2, "prep_ms_p50": 1.5,
                     **none, "sample_ms_p50": None}]


def test_decode_acks_place_each_switch_against_the_step_then_running():
    recs = [_step(10.020, "decode", 4, 4, 0.1, 0.01, measured=20.0), _step(10.040, "decode", 4, 4, 0.1, 0.01, 20.0),
            {"kind": "switch", "t": 10.0375, "decision_to_split_us": 1500, "acked_last": "decode"},  # 4 ms before
            {"kind": "switch", "t": 10.0402, "decision_to_split_us": 1200, "acked_last": "decode"},  # 1 ms before
            {"kind": "switch", "t": 10.0602, "decision_to_split_us": 100, "acked_last": "decode"},   # after the last
            {"kind": "switch", "t": 10.030, "decision_to_split_us": 900, "acked_last": "prefill"}]
    assert decode_acks(recs) == [{"to_collect_ms": 1.0, "acked_ms": 1.2}, {"to_collect_ms": 4.0, "acked_ms": 1.5},
                                 {"to_collect_ms": None, "acked_ms": 0.1}]


def test_main_saves_the_tables_and_refuses_bad_arguments(tmp_path, capsys):
    log = tmp_path / "steps.jsonl"
    collected = {**_step(1, "decode", 6, 6, 0.1, 0.01), "gc_ms": 2.5, "gc_count": 1, "gc_gen": 2}
    startups = [{"kind": "startup", "t": 0, "role": "decode", "seconds": {"gc_freeze": 0.25, "total": 9.0},
                 "gc_frozen": 400000}, {"kind": "startup", "t": 0, "role": "prefill", "seconds": {"total": 9.0}}]
    log.write_text("\n".join(json.dumps(r) for r in [*startups, _step(0, "decode", 4, 4, 0.1, 0.01), collected]) + "\n")
    out = tmp_path / "host_times.json"
    assert main([str(log), "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["logs"][str(log)]["host_times"][0]["prep_ms_p50"] == 0.1
    printed = capsys.readouterr().out
    assert "| decode | 1-16 | 2 | 0.010 | 0.100 |" in printed
    # each worker's timed collections, and its heap freeze at start-up (none: gc_freeze off or a log before it)
    assert saved["logs"][str(log)]["gc"]["decode"]["max_seqs"] == 6
    assert ("garbage collections, decode worker: 1 in 1 steps, 2.5 ms in all, the largest 2.50 ms (at 6 sequences), "
            "1 steps reaching the oldest generation") in printed
    assert "heap frozen at start-up, decode worker: 400000 objects in 0.25 s" in printed
    assert "heap frozen at start-up, prefill worker: no" in printed
    with pytest.raises(SystemExit):
        main([str(log), "--bins", "1-16,x"])
    assert "--bins: bin 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none.jsonl")])
    assert "no such step log" in capsys.readouterr().err


def test_decode_acks_name_the_part_of_the_decode_launch_in_logs_that_date_it():
    """With `launch_began_t` in the step records, each decode-acked switch also says which part of the decode side's
    last launch its decision fell in (`plot_steps.launch_phase`); older logs leave it out."""
    step = {**_step(10.020, "decode", 4, 4, 0.5, 0.01, measured=20.0), "launch_began_t": 10.000, "forward_ms": 15.0,
            "sample_ms": 1.0}
    recs = [step, {"kind": "switch", "t": 10.0023, "decision_to_split_us": 2000, "acked_last": "decode"},  # at 0.3 ms
            {"kind": "switch", "t": 10.0180, "decision_to_split_us": 2000, "acked_last": "decode"}]  # at 16.0 ms
    acks = decode_acks(recs)
    assert [(a["to_collect_ms"], a["phase"]) for a in acks] == [(4.0, "sampling launch"), (19.7, "preparation")]
