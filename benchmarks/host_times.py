"""Host times of served steps by batch size, and where the decode side was at each switch it acked last.

    python -m benchmarks.host_times benchmarks/results/serve_h200_m22/seed16/<system>-steps.jsonl.gz [more logs] \\
        --out benchmarks/results/serve_h200_m22/host_times.json

For each step log: the median planning (`plan_ms`), host preparation (`prep_ms`), forward launch (`forward_ms`:
for a step on one decode graph its set-up, the attention plan included, and replay; for a step in pieces the whole
launch, the waits for its pieces included), a decode graph step's attention plan (`graph_plan_ms`) and the sampling
launch (`sample_ms`), and the longest host wait for the GPU in a decode graph step's set-up
(`graph_wait_ms`: a staging slot's copy, flashinfer's plan fence; logs since the fifty-second session) of its decode-only steps and of its steps with prompt tokens beside decode
rows (the chunked schedule's mixed steps), by batch size (sequences; `--bins`). Planning is code no engine change of the fiftieth session touched, so its ratio between two logs is a
measure of their hosts' speed. Then, for logs with split switches: every switch the decode side acked last, with the
time from its decision to the collect of the decode step the GPU ran then (`plot_steps.slow_switches`' placing) and
the decision-to-ack time, sorted by the former: whether late acks gather at a step's end. Last, per worker, the
garbage collections its step records timed (`plot_steps.gc_summary`, the chunked schedule's log included) and, from
its `startup` record, the objects its heap freeze moved out of the collector's reach (`gc_frozen`, engine.gc_freeze).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.plot_steps import gc_summary, launch_phase, records

DEFAULT_BINS = "1-16,17-48,49-96,97-256"


def parse_bins(text: str) -> list[tuple[int, int]]:
    """"1-16,17-48" -> [(1, 16), (17, 48)]; ValueError naming the bad part."""
    bins = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if not sep or not lo.isdigit() or not hi.isdigit() or int(lo) > int(hi):
            raise ValueError(f"bin {part!r}: want LOW-HIGH, e.g. 1-16")
        bins.append((int(lo), int(hi)))
    return bins


def host_times(recs: list[dict[str, Any]], bins: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """One row per (kind, bin) that has steps: kind "decode" (one token a row) or "mixed" (prompt tokens too, beside
    at least one decode row: more tokens than sequences, not a prefill side's step); steps, median plan_ms, prep_ms,
    forward_ms, graph_plan_ms (a decode graph step's attention plan) and sample_ms (the sampling launch), and the
    longest graph_wait_ms (a decode graph step's host wait for the GPU before its first replay), each None where the
    log has none."""
    steps = [r for r in recs if r.get("kind") == "step" and r.get("prep_ms") is not None and r.get("side") != "prefill"]
    rows = []
    for kind, keep in (("decode", lambda r: r["num_tokens"] == r["num_seqs"]),
                       ("mixed", lambda r: r["num_tokens"] > r["num_seqs"] and r.get("phase") != "prefill")):
        mine = [r for r in steps if keep(r)]
        for lo, hi in bins:
            cell = [r for r in mine if lo <= r["num_seqs"] <= hi]
            if cell:
                waits = [r["graph_wait_ms"] for r in cell if "graph_wait_ms" in r]
                rows.append({"kind": kind, "seqs": f"{lo}-{hi}", "steps": len(cell),
                             "plan_ms_p50": round(statistics.median(r.get("plan_ms", 0.0) for r in cell), 3),
                             "prep_ms_p50": round(statistics.median(r["prep_ms"] for r in cell), 3),
                             **{f"{k}_p50": _median(cell, k) for k in ("forward_ms", "graph_plan_ms", "sample_ms")},
                             "graph_wait_ms_max": round(max(waits), 3) if waits else None})
    return rows


def _median(cell: list[dict[str, Any]], key: str) -> float | None:
    """The median of `key` over the steps that have it (None: none has)."""
    values = [r[key] for r in cell if key in r]
    return round(statistics.median(values), 3) if values else None


def decode_acks(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each switch the decode side acked last: `to_collect_ms` (its decision to the collect of the decode step whose
    GPU span held the decision; None between steps), `acked_ms` and, in logs with launch_began_t, `phase` (the part of
    the decode side's last launch the decision fell in: `plot_steps.launch_phase`), sorted by `to_collect_ms` (None
    last)."""
    decode = sorted((r for r in recs if r.get("kind") == "step" and r.get("side") == "decode"), key=lambda r: r["t"])
    rows: list[dict[str, Any]] = []
    for sw in (r for r in recs if r.get("kind") == "switch" and r.get("acked_last") == "decode"):
        acked_ms = sw["decision_to_split_us"] / 1e3
        decided = sw["t"] - acked_ms / 1e3
        running = next((r for r in decode if r["t"] - r["measured_ms"] / 1e3 <= decided <= r["t"]), None)
        to_collect = round((running["t"] - decided) * 1e3, 3) if running is not None else None
        row: dict[str, Any] = {"to_collect_ms": to_collect, "acked_ms": round(acked_ms, 3)}
        phase = launch_phase(decode, decided)
        if phase is not None:  # logs with launch_began_t: the part of the decode launch the decision fell in
            row["phase"] = phase["phase"]
        rows.append(row)
    return sorted(rows, key=lambda r: (r["to_collect_ms"] is None, r["to_collect_ms"] or 0.0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="step logs (jsonl or jsonl.gz)")
    parser.add_argument("--bins", default=DEFAULT_BINS, help=f"batch-size bins in sequences (default {DEFAULT_BINS})")
    parser.add_argument("--out", type=Path, default=None, help="JSON of every table")
    args = parser.parse_args(argv)
    try:
        bins = parse_bins(args.bins)
    except ValueError as e:
        parser.error(f"--bins: {e}")
    missing = [p for p in args.logs if not Path(p).is_file()]
    if missing:
        parser.error(f"no such step log: {missing[0]}")
    result: dict[str, Any] = {"command": "python -m benchmarks.host_times " + " ".join(argv if argv is not None
                                                                                      else sys.argv[1:]),
                              "logs": {}}
    for path in args.logs:
        recs = records(path)
        rows, acks = host_times(recs, bins), decode_acks(recs)
        steps = [r for r in recs if r.get("kind") == "step"]
        collections = gc_summary(steps)
        frozen = {r["role"]: {"objects": r.get("gc_frozen"), "seconds": r["seconds"].get("gc_freeze")}
                  for r in recs if r.get("kind") == "startup"}
        result["logs"][path] = {"host_times": rows, "decode_acks": acks, "gc": collections, "gc_frozen": frozen}
        print(f"{path}\n| kind | sequences | steps | plan_ms p50 | prep_ms p50 | forward_ms p50 | graph_plan_ms p50 | "
              "sample_ms p50 | graph_wait_ms max |\n|---|---|---|---|---|---|---|---|---|")
        for row in rows:
            cells = ["-" if row[k] is None else f"{row[k]:.3f}"
                     for k in ("forward_ms_p50", "graph_plan_ms_p50", "sample_ms_p50", "graph_wait_ms_max")]
            print(f"| {row['kind']} | {row['seqs']} | {row['steps']} | {row['plan_ms_p50']:.3f} | "
                  f"{row['prep_ms_p50']:.3f} | {' | '.join(cells)} |")
        if acks:
            print("switches decode acked last (decision to the collect of the decode step then on the GPU, ms -> "
                  "decision to ack, ms): " + ", ".join(
                      f"{'between steps' if a['to_collect_ms'] is None else format(a['to_collect_ms'], '.2f')} -> "
                      f"{a['acked_ms']:.2f}" + (f" ({a['phase']})" if a.get("phase") else "") for a in acks))
        for side, row in collections.items():
            print(f"garbage collections, {side} worker: {row['collections']} in {row['steps']} steps, "
                  f"{row['total_ms']:.1f} ms in all, the largest {row['max_ms']:.2f} ms (at {row['max_seqs']} "
                  f"sequences), {row['oldest_gen_steps']} steps reaching the oldest generation")
        for role, row in frozen.items():
            print(f"heap frozen at start-up, {role} worker: "
                  + ("no" if row["objects"] is None else f"{row['objects']} objects in {row['seconds']} s"))
        print()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))
        print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
