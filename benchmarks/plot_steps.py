"""Plot a step log (EngineConfig.step_log_path): predicted vs measured step time, and the split over time.

    python -m benchmarks.plot_steps steps.jsonl --out steps.png
    python -m benchmarks.plot_steps steps.jsonl.gz --requests runs/bullet-slo-rate24.json.gz --out rate24.png

Left: each step's predicted against its measured time (log-log, per side; the diagonal is a perfect model,
the band +-25%). Right: decode SMs over time, with the prefill queue length, and split decisions marked by
reason. Prints the median and p90 of |predicted - measured| / measured per side (the acceptance figure), the
prefill batches taken under a queue, the prefill side's tokens/s beside a busy decode and with decode idle by its
SMs, and the split switches' decision-to-new-split times (p50 / p99, where the last side acked them, and by the deciding
reason and the side that acked last; for those over 1 ms that decode acked last, where its decision found the decode side: in a step that
moved, in one that did not, so the next step took it after its host preparation, or between steps, and, in logs
that carry them, where the decode side acked and the piece where a step moved); with
`--requests`, also that run's streaks of BALANCE decisions and the decode steps they held.
With `--requests` (one rate's run of the bench tool, served while the log was written) a second row zooms
into that run: the split with the queue and decode batch, and each request's TTFT and TPOT at its arrival
against the run's first SLO.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
from collections import Counter
from typing import Any

from benchmarks.rescore import load_run


def steps_and_decisions(recs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(step records, decision records) of a step log's records; switch records are read by `switches`."""
    steps, decisions = [], []
    for record in recs:
        if record.get("kind") == "step":
            steps.append(record)
        elif record.get("kind", "decision") == "decision":
            decisions.append(record)
    return steps, decisions


def records(path: str) -> list[dict]:
    """Every record of a step log (plain or gzipped JSONL), parsed once and handed to the helpers below."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def switches(recs: list[dict]) -> list[float]:
    """Decision-to-new-split times (ms) of the switches both sides acked (their next launches on it), sorted."""
    return sorted(r["decision_to_split_us"] / 1e3 for r in recs if r.get("kind") == "switch")


def drains(recs: list[dict]) -> list[float]:
    """Decision-to-drained times (ms) of the switches that took effect (no step of either side left on the old
    entry), sorted; logs from before the drain was recorded have none."""
    return sorted(r["decision_to_drained_us"] / 1e3 for r in recs if r.get("kind") == "switch_drained")


def switch_summary(recs: list[dict]) -> dict[str, float] | None:
    """A step log's switches in numbers (serve_h100 saves them per system): how many both sides acked and their
    decision-to-ack p50 / p99 (ms), how many drained and their decision-to-drained p50 / p99; None without any."""
    acked, drained = switches(recs), drains(recs)
    if not acked:
        return None
    out = {"acked": len(acked), "acked_p50_ms": round(_q(acked, 0.5), 3), "acked_p99_ms": round(_q(acked, 0.99), 3),
           "drained": len(drained)}
    if drained:
        out.update(drained_p50_ms=round(_q(drained, 0.5), 3), drained_p99_ms=round(_q(drained, 0.99), 3))
    return out


def startup_summary(recs: list[dict]) -> dict[str, dict[str, float]]:
    """Each worker's start-up from its `startup` record (serve_h100's extra.startup): seconds by part
    (`resources`, `partitions`, `piecewise_tune`, `decode_graphs`, `piecewise_graphs`, `warm_pinned`, `total`), by
    role; the last start of each role where the log holds several; {} for logs from before the record existed.
    Where the records say it, also `handles_after_s` (the creating worker's start to its Handles, when the other
    could start) and `done_after_s`: seconds from the creating worker's start (its record's time less its total) to
    this worker's end, so that overlapped start-ups show as a `done_after_s` below the sum of the totals. Only for
    the records of the last start: a worker whose last record began before the creating worker's last start (an
    engine restarted, this worker's record lost) gets none."""
    rows = {r["role"]: r for r in recs if r.get("kind") == "startup"}
    creator = next((rows[role] for role in ("prefill", "hybrid") if role in rows), None)
    began = creator["t"] - creator["seconds"]["total"] if creator and "t" in creator and "total" in creator["seconds"] \
        else None
    out: dict[str, dict[str, float]] = {}
    for role, r in rows.items():
        out[role] = dict(r["seconds"])
        if r.get("handles_after_s") is not None:
            out[role]["handles_after_s"] = r["handles_after_s"]
        start = r["t"] - r["seconds"].get("total", 0.0) if "t" in r else None
        if began is not None and start is not None and start >= began:
            out[role]["done_after_s"] = round(r["t"] - began, 3)
    return out


def prefill_gemm_summary(recs: list[dict]) -> dict[str, Any]:
    """engine.prefill_gemm's tuning from the prefilling worker's last `startup` record (serve_h100's
    extra.prefill_gemm): the report's counts, and per partition size the points kept and their median speedup over
    F.linear (`by_sms`); {} when the log has none (cublas, or a log from before it)."""
    rows = [r for r in recs if r.get("kind") == "startup" and r.get("prefill_gemm")]
    if not rows:
        return {}
    report = rows[-1]["prefill_gemm"]
    by_sms: dict[int, list[dict[str, Any]]] = {}
    for point in report.get("choices", []):
        by_sms.setdefault(point["sms"], []).append(point)
    out = {k: v for k, v in report.items() if k != "choices"}
    out["by_sms"] = {}
    for sms, points in sorted(by_sms.items(), reverse=True):
        kept = sorted(p["base_ms"] / p["ms"] for p in points if p["algo"] is not None and p["ms"] > 0)
        out["by_sms"][sms] = {"points": len(points), "kept": len(kept),
                              "median_speedup": round(kept[len(kept) // 2], 3) if kept else None}
    return out


def handoff_summary(recs: list[dict]) -> dict[str, dict[str, float]]:
    """The prefill -> decode hand-offs of a step log by the way they came ("front": relayed by the engine front,
    "direct": from the prefill worker itself): count and the prefill worker's send -> the decode worker taking it
    p50 / p90 / p99 (ms); {} for logs from before hand-offs were timed."""
    by_via: dict[str, list[float]] = {}
    for r in recs:
        if r.get("kind") == "handoff":
            by_via.setdefault(r["via"], []).append(r["hop_ms"])
    out = {}
    for via, hops in sorted(by_via.items()):
        hops.sort()
        out[via] = {"handoffs": len(hops), **{f"p{round(q * 100)}_ms": round(_q(hops, q), 3) for q in (0.5, 0.9, 0.99)}}
    return out


def drain_idle(recs: list[dict]) -> dict[str, float] | None:
    """What the drains cost in SMs: after a switch that gives prefill more SMs, decode leaves them at its next
    launch while prefill's step on the old entry still runs (its next step waits on it), so the SMs prefill gains
    idle from the acks to the drain when prefill drained last. Summed over the log as SM-milliseconds and as a
    share of the SM time between its first and last step (None without drains or ladder entries)."""
    recs = sorted(recs, key=lambda r: r["t"])
    ladder = {r["split_index"]: r["prefill_sms"] for r in recs if r.get("kind") == "step" and "split_index" in r}
    steps = [r["t"] for r in recs if r.get("kind") == "step"]
    acked: dict[int, float] = {}  # entry -> decision-to-ack ms of the last switch to it
    current, idle_sm_ms, count = None, 0.0, 0
    for r in recs:
        if r.get("kind") == "switch":
            acked[r["index"]] = r["decision_to_split_us"] / 1e3
        elif r.get("kind") == "switch_drained":
            index, grown = r["index"], 0
            if current in ladder and index in ladder:
                grown = ladder[index] - ladder[current]
            if grown > 0 and r["drained_last"] == "prefill" and index in acked:
                idle_sm_ms += grown * max(0.0, r["decision_to_drained_us"] / 1e3 - acked[index])
                count += 1
            current = index
    if current is None or len(steps) < 2:
        return None
    sms = max((r.get("decode_sms", 0) + r.get("prefill_sms", 0) for r in recs if r.get("kind") == "step"), default=0)
    total = (steps[-1] - steps[0]) * 1e3 * sms
    return {"switches": count, "idle_sm_ms": round(idle_sm_ms, 1),
            "share": round(idle_sm_ms / total, 6) if total else math.nan}


def run_start_unix_s(run: dict) -> float:
    """Wall-clock time of the run's first scheduled request. Runs saved before `started_unix_s` existed
    carry only the end time to the second (`date_utc`), so their start is that minus the run's duration."""
    env = run.get("environment", {})
    if env.get("started_unix_s") is not None:
        return float(env["started_unix_s"])
    from datetime import datetime

    end = datetime.fromisoformat(env["date_utc"]).timestamp()
    return end - float(run["summary"]["duration_s"])


def during_run(rows: list[dict], run: dict) -> list[dict]:
    """The step-log records written while one run was served (its first scheduled request to its end)."""
    start = run_start_unix_s(run)
    end = start + float(run["summary"]["duration_s"])
    return [r for r in rows if start <= r["t"] <= end]


def request_points(run: dict) -> tuple[list[tuple[float, float, float | None]], dict]:
    """(arrival s since the run's start, TTFT s, TPOT s or None) per successful request, and the first SLO."""
    points = [(r["scheduled_s"], r["ttft_s"], r.get("tpot_s")) for r in run["requests"]
              if r.get("success") and r.get("ttft_s") is not None]
    slos = run["summary"].get("slo", {})
    first = run["config"]["slos"][0] if run["config"].get("slos") else next(iter(slos), None)
    return points, slos.get(first, {})


def group(step: dict) -> str:
    """A step's group for the model's error: its side, or "mixed" for a decode step with prompt chunks (the
    mixed fallback), predicted as a prefill step of all its tokens."""
    return "mixed" if step.get("phase") == "mixed" else step["side"]


def errors(steps: list[dict], side: str) -> list[float]:
    """|predicted - measured| / measured of the steps of one group (`group`: prefill, decode or mixed)."""
    return sorted(abs(s["predicted_ms"] - s["measured_ms"]) / s["measured_ms"] for s in steps
                  if group(s) == side and s["measured_ms"] > 0 and s["predicted_ms"] > 0)


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


def queued_prefill_batches(steps: list[dict], min_queued: int = 3) -> dict[str, float] | None:
    """The prefill side's steps taken while at least `min_queued` requests waited: how many, the median
    requests and tokens per step, and tokens per second of step time (how the batches are sized under a queue)."""
    mine = [s for s in steps if s["side"] == "prefill" and s["num_queued"] >= min_queued]
    if not mine:
        return None
    return {"steps": len(mine), "seqs_p50": statistics.median(s["num_seqs"] for s in mine),
            "tokens_p50": statistics.median(s["num_tokens"] for s in mine),
            "tokens_per_s": sum(s["num_tokens"] for s in mine) / sum(s["measured_ms"] for s in mine) * 1e3}


def first_token_parts(first_tokens: list[dict], run: dict) -> dict:
    """Medians of the engine's own first-token records of one rate (the worker's `first_token` rows: front ->
    worker, queue, prefill to the collect of the first token, their sum) and what the client's TTFT p50 adds
    to the workers' (p50 minus p50: what is spent outside the workers, in and back: HTTP, Serve, the front).
    {} where the log has none (logs before 2026-11-25)."""
    if not first_tokens:
        return {}
    med = {key: round(statistics.median(r[key] for r in first_tokens), 1)
           for key in ("to_worker_ms", "queue_ms", "prefill_ms", "worker_ttft_ms")}
    return {"first_tokens": len(first_tokens), **{f"engine_{k}_p50": v for k, v in med.items()},
            "client_minus_engine_ttft_p50_ms": round(run["summary"]["ttft_ms"]["p50"] - med["worker_ttft_ms"], 1)}


def first_tokens_of_run(recs: list[dict], run: dict) -> dict:
    """The prefill worker's `first_token` records of one run's window, summarised as step_breakdown does
    ({} for logs without them)."""
    return first_token_parts(during_run([r for r in recs if r.get("kind") == "first_token"], run), run)


def split_of_run(steps: list[dict], decisions: list[dict], run: dict) -> dict | None:
    """How one run's window was split: the policy's decisions by reason (those that switched, of all logged),
    the decode side's decode steps (not the mixed fallback's steps with prompt chunks, `group`) by its SMs (share
    of steps) and their measured p50 / p90 (ms); None without decode steps in the window."""
    decode = [s for s in during_run(steps, run) if group(s) == "decode"]
    if not decode:
        return None
    mine = during_run(decisions, run)
    by_reason: dict[str, list[int]] = {}
    for d in mine:
        row = by_reason.setdefault(d.get("reason", "?"), [0, 0])
        row[0] += bool(d.get("switch"))
        row[1] += 1
    by_sms: dict[int, int] = {}
    for s in decode:
        by_sms[int(s["decode_sms"])] = by_sms.get(int(s["decode_sms"]), 0) + 1
    times = sorted(s["measured_ms"] for s in decode)
    return {"decisions": {k: {"switched": v[0], "logged": v[1]} for k, v in sorted(by_reason.items())},
            "decode_steps": len(decode),
            "decode_share_by_sms": {sms: round(n / len(decode), 3) for sms, n in sorted(by_sms.items())},
            "decode_step_ms_p50": round(_q(times, 0.5), 2), "decode_step_ms_p90": round(_q(times, 0.9), 2)}


def prefill_rate_by_sms(steps: list[dict], min_tokens: int = 1500, other_busy: bool = True) -> dict[int, dict[str, float]]:
    """Prefill steps of >= `min_tokens` tokens taken while the decode side was busy (`other_busy`; False: idle), by
    their prefill SMs: how many, and their median tokens per second of step time (what the prefill side beside
    decode delivers, or alone)."""
    by_sms: dict[int, list[float]] = {}
    for s in steps:
        if s["side"] == "prefill" and bool(s.get("other_busy")) == other_busy and s["num_tokens"] >= min_tokens \
                and s["measured_ms"] > 0:
            by_sms.setdefault(int(s["prefill_sms"]), []).append(s["num_tokens"] / s["measured_ms"] * 1e3)
    return {sms: {"steps": len(rates), "tokens_per_s_p50": statistics.median(rates)}
            for sms, rates in sorted(by_sms.items())}


BALANCE_REASONS = ("balance", "balance_tpot")


def balance_streaks(decisions: list[dict], steps: list[dict], gap_s: float = 0.5) -> list[dict[str, Any]]:
    """Runs of logged BALANCE decisions (TTFT at risk with decode over its TPOT target; every one is logged) with no
    other logged decision between them and at most `gap_s` apart, with the decode steps taken meanwhile: when
    (log time), how many decisions, the decode SMs, batch and measured step times (ms) in the streak."""
    streaks: list[list[dict]] = []
    for d in sorted(decisions, key=lambda d: d["t"]):
        if d.get("reason") not in BALANCE_REASONS:
            if streaks and streaks[-1]:
                streaks.append([])
            continue
        if streaks and streaks[-1] and d["t"] - streaks[-1][-1]["t"] <= gap_s:
            streaks[-1].append(d)
        else:
            streaks.append([d])
    out = []
    for streak in (s for s in streaks if s):
        t0, t1 = streak[0]["t"], streak[-1]["t"]
        decode = [s for s in steps if group(s) == "decode" and t0 <= s["t"] <= t1]
        times = [s["measured_ms"] for s in decode]
        out.append({"t_start": t0, "t_end": t1, "decisions": len(streak),
                    "decode_sms": sorted({int(s["decode_sms"]) for s in decode}),
                    "decode_seqs": (min((s["num_seqs"] for s in decode), default=0),
                                    max((s["num_seqs"] for s in decode), default=0)),
                    "decode_step_ms": (round(min(times), 1), round(max(times), 1)) if times else None})
    return out


def moved_while_launching(steps: list[dict[str, Any]]) -> dict[str, int]:
    """Steps per side that followed a switch in the middle of their launch (a layer-wise prefill between its
    groups, a decode step between its pieces: the step log's `moved_while_launching`)."""
    counts: dict[str, int] = {}
    for r in steps:
        if r.get("moved_while_launching"):
            counts[r["side"]] = counts.get(r["side"], 0) + 1
    return counts


def first_replays(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    """Decode steps on captured graphs, the first of each (split, bucket, split it moved to) against the rest: how
    many, and how far their measured time ran over the model's prediction (ms; first uses: median and max; the
    rest: p99). A graph's first launch costs more (its upload): a first use far over the rest's tail is one paid
    while serving. The log does not name a step's plan variant (split-KV or not), so a bucket's second variant
    counts with the rest; a step that moved is timed against its planned entry's prediction, so its first use
    also carries the move's own cost."""
    from bullet_ray.engine.cuda_graphs import BUCKETS

    seen: set[tuple[Any, ...]] = set()
    first: list[float] = []
    rest: list[float] = []
    for r in steps:
        if r.get("side") != "decode" or r.get("graphs") != "decode" or not r.get("predicted_ms"):
            continue
        bucket = next((b for b in BUCKETS if b >= r["num_seqs"]), None)
        key = (r.get("split_index"), bucket, r.get("runs_on"))
        (rest if key in seen else first).append(r["measured_ms"] - r["predicted_ms"])
        seen.add(key)
    if not first or not rest:
        return None
    return {"first": len(first), "first_p50_ms": statistics.median(first), "first_max_ms": max(first),
            "rest": len(rest), "rest_p99_ms": sorted(rest)[min(len(rest) - 1, int(0.99 * len(rest)))]}


def decode_step_medians(steps: list[dict[str, Any]], min_steps: int = 200) -> dict[tuple[int, int], dict[str, float]]:
    """Decode steps on captured graphs by (decode SMs, graph bucket), where a cell holds >= `min_steps`: how many,
    and their median measured and predicted ms (what a change to the decode graphs costs per step, cell by cell)."""
    from bullet_ray.engine.cuda_graphs import BUCKETS

    cells: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in steps:
        if r.get("side") == "decode" and r.get("graphs") == "decode" and r.get("predicted_ms"):
            bucket = next((b for b in BUCKETS if b >= r["num_seqs"]), BUCKETS[-1])
            cells.setdefault((int(r["decode_sms"]), bucket), []).append(r)
    return {key: {"steps": len(rows), "measured_ms": statistics.median(r["measured_ms"] for r in rows),
                  "predicted_ms": statistics.median(r["predicted_ms"] for r in rows)}
            for key, rows in sorted(cells.items()) if len(rows) >= min_steps}


def piece_waits_cut(steps: list[dict[str, Any]]) -> tuple[int, int]:
    """(decode steps where a requested split cut the host's wait for a piece, the waits cut: the step log's
    `piece_waits_cut`)."""
    cut = [r.get("piece_waits_cut", 0) for r in steps if r.get("side") == "decode" and r.get("piece_waits_cut")]
    return len(cut), sum(cut)


def poll_gaps(steps: list[dict[str, Any]]) -> tuple[int, float, float, float] | None:
    """(decode steps in pieces with a polled wait, and the p50, p99 and max of each one's longest gap in ms between
    the host's looks at a requested split: the step log's `piece_poll_gap_ms`); None in logs without it."""
    gaps = sorted(r["piece_poll_gap_ms"] for r in steps if r.get("side") == "decode" and "piece_poll_gap_ms" in r)
    return (len(gaps), _q(gaps, 0.5), _q(gaps, 0.99), gaps[-1]) if gaps else None


def gc_summary(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per side, the garbage collections the step log timed (`gc_ms`, `gc_count`, `gc_gen` on the record of the step
    collected after them: engine.gc_freeze's effect shows here): steps with one, collections, their total and
    largest per-step time (ms) with that step's sequences, and the steps whose collections reached the oldest
    generation (2). Sides whose log
    carries none are left out (a log before the fifty-first session, or no collection at all)."""
    out: dict[str, dict[str, float]] = {}
    for side in sorted({r.get("side") for r in steps if r.get("gc_count")}):
        rows = [r for r in steps if r.get("side") == side and r.get("gc_count")]
        largest = max(rows, key=lambda r: r["gc_ms"])
        out[side] = {"steps": len(rows), "collections": sum(r["gc_count"] for r in rows),
                     "total_ms": round(sum(r["gc_ms"] for r in rows), 3),
                     "max_ms": largest["gc_ms"], "max_seqs": largest.get("num_seqs"),
                     "p99_ms": _q(sorted(r["gc_ms"] for r in rows), 0.99),
                     "oldest_gen_steps": sum(1 for r in rows if r.get("gc_gen") == 2)}
    return out


LAUNCH_PHASES = ("preparation", "graph set-up", "forward", "sampling launch")


def launch_phase(decode: list[dict[str, Any]], decided: float) -> dict[str, Any] | None:
    """Where in the decode side's host timeline a decision made at wall time `decided` fell: the decode step whose
    launch began last before it (`launch_began_t`, logs since the fifty-second session; None without one) and the
    part of that launch it fell in, laid end to end from the step's host times: its `preparation` (`prep_ms`, and
    `look_ms`: a decode step in pieces looks at a requested split once prepared), its
    `graph set-up` before the first replay (`graph_setup_ms`, graph steps), the rest of its `forward` (the pieces and
    their waits, or the one replay), its `sampling launch` (`sample_ms`), else "after the launch" (the loop: the
    collect of the step before, outputs, messages, the next plan). Returns `phase`, `into_ms` (decision minus the
    launch's start), `phase_ms` (how long that part took; None after the launch), `since_phase_ms` (the decision
    minus the part's start) and the step's `seqs`."""
    began = [r for r in decode if r.get("launch_began_t") is not None and r["launch_began_t"] <= decided]
    if not began:
        return None
    step = max(began, key=lambda r: r["launch_began_t"])
    into = (decided - step["launch_began_t"]) * 1e3
    setup = step.get("graph_setup_ms") or 0.0
    prep = step.get("prep_ms", 0.0) + step.get("look_ms", 0.0)  # with the look at a requested split after it
    parts = (prep, setup, step.get("forward_ms", 0.0) - setup, step.get("sample_ms", 0.0))
    start = 0.0
    for name, length in zip(LAUNCH_PHASES, parts):
        if length > 0 and into < start + length:
            return {"phase": name, "into_ms": round(into, 3), "phase_ms": round(length, 3),
                    "since_phase_ms": round(into - start, 3), "seqs": step["num_seqs"]}
        start += max(length, 0.0)
    return {"phase": "after the launch", "into_ms": round(into, 3), "phase_ms": None,
            "since_phase_ms": round(into - start, 3), "seqs": step["num_seqs"]}


def acked_sites(recs: list[dict[str, Any]]) -> dict[str, int]:
    """How many switches the last side to ack took at each place in its worker (the switch record's `site`: prefill's
    `plan`; decode's `loop`, `launch`, `prep` once a step's inputs are prepared, `piece` between pieces, `sample`
    before a step's sampling launch; a record without one: `-`), most first."""
    counts = Counter(r.get("site") or "-" for r in recs if r.get("kind") == "switch")
    return dict(counts.most_common())


def slow_switches(recs: list[dict[str, Any]], over_ms: float = 1.0) -> list[dict[str, Any]]:
    """Where the decode side was when each switch it acked last, slower than `over_ms`, was decided (the switch
    record's `t` is its ack; the decision came `decision_to_split_us` before). A decode step's span is its record's
    `t` (when it was collected) less `measured_ms`. One dict a switch: `acked_ms`; `where`: "moved in its step" (the
    step in flight moved while launching), "next step" (it did not; the next decode step took the split), or
    "between steps" (none in flight); the step in flight's `step_seqs` and `ms_to_collect` (decision to its collect);
    the next step's `next_plan_ms` and `next_prep_ms` (its planning and host preparation) and `next_moved`; where
    the decode side acked (`site`: loop, launch, prep, piece or sample; `inflight`: an earlier step uncollected; `launching`: inside
    a step's launch; `since_collect_ms`), the boundary where the step in flight or the next one moved
    (`step_moved_at_piece`, `next_moved_at_piece`), the next one's longest gap between its looks at a requested
    split (`next_poll_gap_ms`), its host time before its first graph replay and the attention plan's part of it
    (`next_graph_setup_ms`, `next_graph_plan_ms`) and the host's waits for the GPU in that (`next_graph_wait_ms`), the
    time the acking process spent in garbage collections
    between the decision and its ack (`gc_ms`), and the decision against that side's launches (`launch_began_ms`:
    after its last launch began; `launch_ended_ms`: after the last one that had returned ended), and the part of
    that launch the decision fell in (`launch_phase`, `launch_phase()`), in logs that carry them."""
    decode = sorted((r for r in recs if r.get("kind") == "step" and r.get("side") == "decode"), key=lambda r: r["t"])
    out = []
    for sw in sorted((r for r in recs if r.get("kind") == "switch"), key=lambda r: r["t"]):
        acked_ms = sw["decision_to_split_us"] / 1e3
        if acked_ms <= over_ms or sw.get("acked_last") != "decode":
            continue
        decided = sw["t"] - acked_ms / 1e3
        running = next((r for r in decode if r["t"] - r["measured_ms"] / 1e3 <= decided <= r["t"]), None)
        after = [r for r in decode if r["t"] - r["measured_ms"] / 1e3 > decided
                 or (running is not None and r["t"] > running["t"])]
        nxt = after[0] if after else None
        row: dict[str, Any] = {"acked_ms": acked_ms, "next_prep_ms": nxt.get("prep_ms") if nxt else None,
                               "site": sw.get("site"), "inflight": sw.get("inflight"),
                               "launching": sw.get("launching"), "since_collect_ms": sw.get("since_collect_ms"),
                               "gc_ms": sw.get("gc_ms"), "launch_began_ms": sw.get("launch_began_ms"),
                               "launch_ended_ms": sw.get("launch_ended_ms"),
                               "next_plan_ms": nxt.get("plan_ms") if nxt else None,
                               "next_moved": bool(nxt and nxt.get("moved_while_launching")),
                               "next_moved_at_piece": nxt.get("moved_at_piece") if nxt else None,
                               "next_poll_gap_ms": nxt.get("piece_poll_gap_ms") if nxt else None,
                               "next_graph_setup_ms": nxt.get("graph_setup_ms") if nxt else None,
                               "next_graph_plan_ms": nxt.get("graph_plan_ms") if nxt else None,
                               "next_graph_wait_ms": nxt.get("graph_wait_ms") if nxt else None}
        phase = launch_phase(decode, decided)
        if phase is not None:
            row["launch_phase"] = phase
        if running is None:
            row["where"] = "between steps"
        else:
            row.update(step_seqs=running["num_seqs"], ms_to_collect=round((running["t"] - decided) * 1e3, 3),
                       step_moved_at_piece=running.get("moved_at_piece"))
            row["where"] = "moved in its step" if running.get("moved_while_launching") else "next step"
        out.append(row)
    return out


def prep_quantiles(steps: list[dict[str, Any]], min_seqs: int = 1) -> tuple[int, float, float] | None:
    """(decode steps of >= `min_seqs` sequences with a `prep_ms`, its median, its p90); None without any."""
    prep = sorted(r["prep_ms"] for r in steps if r.get("side") == "decode" and r.get("num_seqs", 0) >= min_seqs
                  and r.get("prep_ms") is not None)
    return (len(prep), _q(prep, 0.5), _q(prep, 0.9)) if prep else None


def switches_by_reason(recs: list[dict]) -> dict[tuple[str, str], dict[str, float]]:
    """Completed switches grouped by (the switching decision's reason, the side that acked last): how many and
    their decision-to-new-split time (ms) median and max. A switch belongs to the last switching decision
    logged before it."""
    recs = sorted(recs, key=lambda r: r["t"])
    groups: dict[tuple[str, str], list[float]] = {}
    reason = "?"
    for r in recs:
        if r.get("kind", "decision") == "decision" and r.get("switch"):
            reason = r["reason"]
        elif r.get("kind") == "switch":
            groups.setdefault((reason, r["acked_last"]), []).append(r["decision_to_split_us"] / 1e3)
    return {key: {"switches": len(ms), "p50_ms": statistics.median(ms), "max_ms": max(ms)}
            for key, ms in sorted(groups.items())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="JSONL (or .jsonl.gz) written by the engine (step_log_path) under the split "
                                    "schedule (prefill and decode sides)")
    parser.add_argument("--out", default="steps.png", help="PNG to write")
    parser.add_argument("--requests", default=None,
                        help="one rate's bench result served while the log was written: adds a row zoomed into it")
    args = parser.parse_args(argv)
    recs = records(args.log)  # parsed once; every section below reads these
    steps, decisions = steps_and_decisions(recs)
    if not steps:
        raise SystemExit(f"{args.log}: no step records")
    if not any(s["side"] in ("prefill", "decode") for s in steps):  # e.g. the chunked schedule's hybrid worker
        raise SystemExit(f"{args.log}: no prefill or decode side's steps (sides: "
                         f"{', '.join(sorted({s['side'] for s in steps}))}); plot_steps reads the split schedule's log")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s["t"] for s in steps + decisions)
    run = load_run(args.requests) if args.requests else None
    if run is None:
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    else:
        fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(13, 10))
    for side, color in (("prefill", "tab:orange"), ("decode", "tab:blue"), ("mixed", "tab:purple")):
        mine = [s for s in steps if group(s) == side]
        if not mine:
            continue
        errs = errors(steps, side)
        print(f"{side}: {len(mine)} steps, |predicted - measured| / measured median {_q(errs, 0.5):.3f}, "
              f"p90 {_q(errs, 0.9):.3f}")
        ax1.scatter([s["measured_ms"] for s in mine], [s["predicted_ms"] for s in mine], s=6, alpha=0.5,
                    color=color, label=f"{side} (median err {_q(errs, 0.5):.0%})")
    lo = min(min(s["measured_ms"], s["predicted_ms"]) for s in steps)
    hi = max(max(s["measured_ms"], s["predicted_ms"]) for s in steps)
    line = [max(lo, 1e-3), hi]
    ax1.plot(line, line, "k-", lw=1)
    ax1.fill_between(line, [v * 0.75 for v in line], [v * 1.25 for v in line], color="gray", alpha=0.15)
    ax1.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)",
            title="performance model: predicted vs measured")
    ax1.legend()
    decode = sorted((s for s in steps if s["side"] == "decode"), key=lambda s: s["t"])
    prefill = sorted((s for s in steps if s["side"] == "prefill"), key=lambda s: s["t"])
    both = sorted(steps, key=lambda s: s["t"])
    ax2.step([s["t"] - t0 for s in both], [s["decode_sms"] for s in both], where="post", color="tab:blue",
             label="decode SMs (the rest: prefill)")
    ax2.set(xlabel="time (s)", ylabel="decode SMs", title="SM split over time")
    for d in decisions:
        if d.get("switch"):
            color = {"balance": "tab:red", "balance_tpot": "tab:orange", "mixed": "tab:purple"}.get(d["reason"], "tab:gray")
            ax2.axvline(d["t"] - t0, color=color, lw=0.3 if color == "tab:gray" else 0.6, alpha=0.5)
    queue = ax2.twinx()
    queue.plot([s["t"] - t0 for s in prefill], [s["num_queued"] for s in prefill], color="tab:orange", lw=0.8,
               label="prefill queue")
    queue.plot([s["t"] - t0 for s in decode], [s["num_seqs"] for s in decode], color="tab:green", lw=0.8,
               label="decode batch")
    if any(s["num_queued"] for s in decode):  # prompts handed to decode by the mixed fallback
        queue.plot([s["t"] - t0 for s in decode], [s["num_queued"] for s in decode], color="tab:purple", lw=0.8,
                   label="prompts waiting on decode (mixed)")
    queue.set_ylabel("requests")
    handles = ax2.get_legend_handles_labels()[0] + queue.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="upper right")
    queued = queued_prefill_batches(steps)
    if queued:
        print(f"prefill steps with >= 3 queued: {queued['steps']}, median {queued['seqs_p50']:g} requests / "
              f"{queued['tokens_p50']:g} tokens per step, {queued['tokens_per_s']:.0f} tokens/s")
    for sms, row in prefill_rate_by_sms(steps).items():
        print(f"prefill steps of >= 1500 tokens beside a busy decode on {sms} SMs: {row['steps']}, "
              f"median {row['tokens_per_s_p50']:.0f} tokens/s")
    for sms, row in prefill_rate_by_sms(steps, other_busy=False).items():
        print(f"prefill steps of >= 1500 tokens with decode idle on {sms} SMs: {row['steps']}, "
              f"median {row['tokens_per_s_p50']:.0f} tokens/s")
    done = switches(recs)
    if done:
        print(f"switches: {len(done)}, decision to both sides launching on the new split (acked) p50 "
              f"{_q(done, 0.5):.3f} ms, p90 {_q(done, 0.9):.3f} ms, p99 {_q(done, 0.99):.3f} ms; under 1 ms: "
              f"{sum(ms < 1.0 for ms in done)}; the largest {', '.join(f'{ms:.2f}' for ms in done[-3:])} ms")
        sites = acked_sites(recs)
        if sites:
            print("  acked last at: " + ", ".join(f"{site} {n}" for site, n in sites.items()))
        drained = drains(recs)
        if drained:
            print(f"  drained (no step of either side left on the old split): {len(drained)}, p50 "
                  f"{_q(drained, 0.5):.3f} ms, p99 {_q(drained, 0.99):.3f} ms")
            idle = drain_idle(recs)
            if idle is not None:
                print(f"  SMs prefill gained, idle from the acks to the drain: {idle['switches']} switches, "
                      f"{idle['idle_sm_ms']:.0f} SM-ms, {idle['share']:.4%} of the log's SM time")
        for (reason, last), row in switches_by_reason(recs).items():
            print(f"  after a {reason} decision, {last} acked last: {row['switches']}, p50 {row['p50_ms']:.1f} ms, "
                  f"max {row['max_ms']:.1f} ms")
        moved = moved_while_launching(steps)
        if moved:
            print("  steps that moved to another split while launching (between layer groups or decode pieces): "
                  + ", ".join(f"{side} {n}" for side, n in moved.items()))
        cut_steps, cut_waits = piece_waits_cut(steps)
        if cut_steps:
            print(f"  decode steps whose wait for a piece a requested split cut short: {cut_steps} ({cut_waits} waits)")
        gaps = poll_gaps(steps)
        if gaps is not None:
            print(f"  the longest gap between the host's looks at a requested split, per decode step in pieces: "
                  f"{gaps[0]} steps, p50 {gaps[1]:.3f} ms, p99 {gaps[2]:.3f} ms, max {gaps[3]:.3f} ms")
        for side, row in gc_summary(steps).items():
            print(f"  garbage collections timed in the {side} worker: {row['collections']} in {row['steps']} steps, "
                  f"{row['total_ms']:.1f} ms in all, per step p99 {row['p99_ms']:.3f} / max {row['max_ms']:.3f} ms, "
                  f"{row['oldest_gen_steps']} steps reaching the oldest generation")
        slow = slow_switches(recs)  # the switches the goal (p99 < 1 ms) misses: where decode was
        if slow:
            wheres = Counter(row["where"] for row in slow)
            print(f"  switches over 1 ms acked last by decode: {len(slow)}, decode taking the split "
                  + ", ".join(f"{where}: {n}" for where, n in wheres.items()) + "; the largest:")
            collected = [row for row in slow if row.get("gc_ms")]
            if any(row.get("gc_ms") is not None for row in slow):
                pauses = ", ".join(f"{r['gc_ms']:.2f}" for r in collected)
                print(f"    of them {len(collected)} with a garbage collection in the acking process between the decision "
                      f"and the ack" + (f" ({pauses} ms)" if collected else ""))
        for row in sorted(slow, key=lambda r: -r["acked_ms"])[:3]:
            if "step_seqs" in row:
                at = f" at piece {row['step_moved_at_piece']}" if row.get("step_moved_at_piece") is not None else ""
                seen = (f"the {row['step_seqs']}-sequence decode step in flight (collected {row['ms_to_collect']:.1f} "
                        f"ms later) {'moved while launching' + at if row['where'] == 'moved in its step' else 'did not move'}")
            else:
                seen = "no decode step in flight"
            if row["next_prep_ms"] is not None:
                prep = prep_quantiles(steps, int(row.get("step_seqs", 1) * 0.9))
                plan = f"planning {row['next_plan_ms']:.2f} ms, " if row["next_plan_ms"] is not None else ""
                at = f" at piece {row['next_moved_at_piece']}" if row.get("next_moved_at_piece") is not None else ""
                if row.get("next_poll_gap_ms") is not None:
                    at += f" (longest gap between its looks at the request {row['next_poll_gap_ms']:.2f} ms)"
                if row.get("next_graph_setup_ms") is not None:
                    waited = row.get("next_graph_wait_ms")
                    plan += (f"graph set-up {row['next_graph_setup_ms']:.2f} ms (attention plan "
                             f"{row['next_graph_plan_ms']:.2f}"
                             + (f", waiting for the GPU {waited:.2f}" if waited is not None else "") + "), ")
                seen += (f"; the next {'moved while launching' + at if row['next_moved'] else 'did not move'}, its {plan}host "
                         f"preparation {row['next_prep_ms']:.2f} ms"
                         + (f" (decode steps of >= 90% that batch: p50 {prep[1]:.2f}, p90 {prep[2]:.2f} ms)" if prep else ""))
            if row["site"] is not None:
                since = row["since_collect_ms"]
                seen += (f"; acked at its {row['site']}{' inside a launch' if row.get('launching') else ''}, "
                         f"{'an earlier step uncollected' if row['inflight'] else 'every earlier step collected'}, "
                         + (f"{since:.2f} ms after its last collect" if since is not None else "idle before"))
            if row.get("gc_ms"):
                seen += f"; {row['gc_ms']:.2f} ms of it in garbage collections"
            if row.get("launch_began_ms") is not None:
                seen += f"; decided {row['launch_began_ms']:.2f} ms after its last launch began"
                if row.get("launch_ended_ms") is not None:
                    seen += f", {row['launch_ended_ms']:.2f} ms after the last one that returned had ended"
            phase = row.get("launch_phase")
            if phase is not None:
                seen += (f"; decided {phase['into_ms']:.2f} ms into the launch of a {phase['seqs']}-sequence decode "
                         f"step, " + (f"{phase['since_phase_ms']:.2f} ms into its {phase['phase']} "
                                      f"({phase['phase_ms']:.2f} ms long)" if phase["phase_ms"] is not None
                                      else f"{phase['since_phase_ms']:.2f} ms after that launch"))
            print(f"    {row['acked_ms']:.2f} ms: at its decision {seen}")
    medians = decode_step_medians(steps)
    if medians:
        print("decode steps on graphs by (decode SMs, bucket), median measured / predicted ms: "
              + ", ".join(f"({sms}, {b}) {m['measured_ms']:.2f} / {m['predicted_ms']:.2f} ({m['steps']})"
                          for (sms, b), m in medians.items()))
    replays = first_replays(steps)
    if replays is not None:
        print(f"decode graphs' first uses (split, bucket, split moved to): {replays['first']}, measured over "
              f"predicted p50 {replays['first_p50_ms']:.1f} ms, max {replays['first_max_ms']:.1f} ms; the other "
              f"{replays['rest']} steps p99 {replays['rest_p99_ms']:.1f} ms")
    for role, parts in startup_summary(recs).items():
        print(f"{role} worker start-up: " + ", ".join(f"{part} {s:.1f} s" for part, s in parts.items()))
    for via, row in handoff_summary(recs).items():
        print(f"hand-offs via {via}: {row['handoffs']}, prefill send -> decode takes it p50 {row['p50_ms']} ms, "
              f"p90 {row['p90_ms']} ms, p99 {row['p99_ms']} ms")
    if run is not None:
        plot_run(ax3, ax4, steps, run)
        parts = first_tokens_of_run(recs, run)
        if parts:
            print(f"first tokens of this run: {parts['first_tokens']}, medians: front -> worker "
                  f"{parts['engine_to_worker_ms_p50']} ms, queue {parts['engine_queue_ms_p50']}, prefill "
                  f"{parts['engine_prefill_ms_p50']}, the engine's TTFT {parts['engine_worker_ttft_ms_p50']}; the "
                  f"client's TTFT p50 is {parts['client_minus_engine_ttft_p50_ms']} ms above it (outside the "
                  f"workers: HTTP, Serve, the front, in and back)")
        split = split_of_run(steps, decisions, run)
        if split:
            print("decisions of this run (switched / logged): " + ", ".join(
                f"{k} {v['switched']}/{v['logged']}" for k, v in split["decisions"].items()))
            print(f"decode steps of this run: {split['decode_steps']}, measured p50 {split['decode_step_ms_p50']} ms, "
                  f"p90 {split['decode_step_ms_p90']} ms; share by decode SMs: " + ", ".join(
                      f"{sms}: {share:.0%}" for sms, share in split["decode_share_by_sms"].items()))
        start = run_start_unix_s(run)
        for b in balance_streaks(during_run(decisions, run), during_run(steps, run)):
            if b["decisions"] >= 3:
                print(f"balance streak of this run: {b['t_start'] - start:.2f}-{b['t_end'] - start:.2f} s after its "
                      f"start, {b['decisions']} decisions, decode on {b['decode_sms']} SMs, batch "
                      f"{b['decode_seqs'][0]}-{b['decode_seqs'][1]}, steps {b['decode_step_ms']} ms")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


def plot_run(ax_split: Any, ax_req: Any, steps: list[dict], run: dict) -> None:
    """The row zoomed into one run: the split, queue and decode batch; each request's TTFT and TPOT."""
    start = run_start_unix_s(run)
    window = sorted(during_run(steps, run), key=lambda s: s["t"])
    rate = run["config"]["workload"].get("rate_rps")
    label = run["config"].get("label") or "run"
    ax_split.step([s["t"] - start for s in window], [s["decode_sms"] for s in window], where="post",
                  color="tab:blue", label="decode SMs")
    ax_split.set(xlabel="time since the run's first request (s)", ylabel="decode SMs",
                 title=f"{label} at {rate} req/s: the split")
    counts = ax_split.twinx()
    for side, key, color, name in (("prefill", "num_queued", "tab:orange", "prefill queue"),
                                   ("decode", "num_seqs", "tab:green", "decode batch")):
        mine = [s for s in window if s["side"] == side]
        counts.plot([s["t"] - start for s in mine], [s[key] for s in mine], color=color, lw=0.8, label=name)
    counts.set_ylabel("requests")
    handles = ax_split.get_legend_handles_labels()[0] + counts.get_legend_handles_labels()[0]
    ax_split.legend(handles, [h.get_label() for h in handles], loc="upper left")
    points, slo = request_points(run)
    ax_req.scatter([p[0] for p in points], [p[1] for p in points], s=8, color="tab:orange", label="TTFT")
    if slo.get("ttft_s"):
        ax_req.axhline(slo["ttft_s"], color="tab:orange", ls="--", lw=1, label=f"TTFT target ({slo.get('name')})")
    ax_req.set(xlabel="arrival since the run's first request (s)", ylabel="TTFT (s)", yscale="log",
               title=f"each request (attainment {slo.get('attainment', math.nan):.0%} under {slo.get('name')})")
    tpot = ax_req.twinx()
    tpot.scatter([p[0] for p in points if p[2]], [p[2] * 1e3 for p in points if p[2]], s=8, marker="x",
                 color="tab:green", label="TPOT")
    if slo.get("tpot_s"):
        tpot.axhline(slo["tpot_s"] * 1e3, color="tab:green", ls="--", lw=1, label="TPOT target")
    tpot.set_ylabel("TPOT (ms)")
    handles = ax_req.get_legend_handles_labels()[0] + tpot.get_legend_handles_labels()[0]
    # a band above the points for the legend (the latest requests sit top left, where it would cover them)
    low, high = ax_req.get_ylim()
    ax_req.set_ylim(low, high * 4)  # log scale
    low, high = tpot.get_ylim()
    tpot.set_ylim(low, high + (high - low) * 0.3)
    ax_req.legend(handles, [h.get_label() for h in handles], loc="upper left", ncol=2, fontsize="small")


if __name__ == "__main__":
    raise SystemExit(main())
