"""Decode step times of two serving runs side by side, per (decode SMs, batch bucket): the A/B of an engine
change that the policy may not exploit in goodput (it plans with its profile) but that shows in each step.

Reads two step logs (`<system>-steps.jsonl[.gz]`, the bullet sides' per-step records) and, for decode steps
replayed through decode graphs, prints the median measured step time of each (decode SMs, batch of 16s)
cell both logs have at least `--min-steps` steps in, and B / A.

    python -m benchmarks.step_ab benchmarks/results/serve_h100_m2r/bullet-slo+direct-steps.jsonl.gz \\
        benchmarks/results/serve_h100_m2r/gemm_sm_target_off/bullet-slo+direct-steps.jsonl.gz \\
        --labels tuned,off --out benchmarks/results/serve_h100_m2r/gemm_sm_target_ab.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any


def decode_cells(path: str | Path, batch_step: int = 16) -> dict[tuple[int, int], list[float]]:
    """Measured ms of graph-replayed decode steps by (decode SMs, batch rounded down to `batch_step`)."""
    opener: Any = gzip.open if str(path).endswith(".gz") else open
    cells: dict[tuple[int, int], list[float]] = defaultdict(list)
    with opener(path, "rt") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "step" and rec.get("side") == "decode" and rec.get("graphs") == "decode":
                cells[(int(rec["decode_sms"]), rec["num_seqs"] // batch_step * batch_step)].append(rec["measured_ms"])
    return cells


def compare(a: dict, b: dict, min_steps: int) -> list[dict[str, Any]]:
    rows = []
    for key in sorted(set(a) & set(b)):
        if len(a[key]) >= min_steps and len(b[key]) >= min_steps:
            ma, mb = statistics.median(a[key]), statistics.median(b[key])
            rows.append({"decode_sms": key[0], "batch_from": key[1], "a_ms": round(ma, 3), "a_steps": len(a[key]),
                         "b_ms": round(mb, 3), "b_steps": len(b[key]), "b_over_a": round(mb / ma, 3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="step log A")
    parser.add_argument("b", help="step log B")
    parser.add_argument("--labels", default="a,b", help="names of A and B, comma-separated")
    parser.add_argument("--min-steps", type=int, default=30, help="steps a cell needs in both logs")
    parser.add_argument("--out", type=Path, default=None, help="JSON of the table")
    args = parser.parse_args(argv)
    la, lb = (args.labels.split(",") + ["b"])[:2]
    rows = compare(decode_cells(args.a), decode_cells(args.b), args.min_steps)
    print(f"{'decode SMs':>10} {'batch':>6} {la + ' ms':>10} {'steps':>6} {lb + ' ms':>10} {'steps':>6} {lb + '/' + la:>8}")
    for r in rows:
        print(f"{r['decode_sms']:>10} {str(r['batch_from']) + '+':>6} {r['a_ms']:>10.2f} {r['a_steps']:>6} "
              f"{r['b_ms']:>10.2f} {r['b_steps']:>6} {r['b_over_a']:>8.3f}")
    if rows:
        print(f"median {lb}/{la} over cells: {statistics.median(r['b_over_a'] for r in rows):.3f}")
    if args.out:
        args.out.write_text(json.dumps({"a": str(args.a), "b": str(args.b), "labels": [la, lb],
                                        "min_steps": args.min_steps, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
