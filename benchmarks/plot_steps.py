"""Plot a step log (EngineConfig.step_log_path): predicted vs measured step time, and the split over time.

    python -m benchmarks.plot_steps steps.jsonl --out steps.png

Left: each step's predicted against its measured time (log-log, per side; the diagonal is a perfect model,
the band +-25%). Right: decode SMs over time, with the prefill queue length, and split decisions marked by
reason. Prints the median and p90 of |predicted - measured| / measured per side (the acceptance figure).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math


def load(path: str) -> tuple[list[dict], list[dict]]:
    """(step records, decision records); switch records are read by `switches`."""
    steps, decisions = [], []
    for record in records(path):
        if record.get("kind") == "step":
            steps.append(record)
        elif record.get("kind", "decision") == "decision":
            decisions.append(record)
    return steps, decisions


def records(path: str) -> list[dict]:
    """Every record of a step log (plain or gzipped JSONL)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def switches(path: str) -> list[float]:
    """Decision-to-new-split times (ms) of the switches both sides completed, sorted."""
    return sorted(r["decision_to_split_us"] / 1e3 for r in records(path) if r.get("kind") == "switch")


def errors(steps: list[dict], side: str) -> list[float]:
    return sorted(abs(s["predicted_ms"] - s["measured_ms"]) / s["measured_ms"] for s in steps
                  if s["side"] == side and s["measured_ms"] > 0 and s["predicted_ms"] > 0)


def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="JSONL written by the engine (step_log_path)")
    parser.add_argument("--out", default="steps.png", help="PNG to write")
    args = parser.parse_args(argv)
    steps, decisions = load(args.log)
    if not steps:
        raise SystemExit(f"{args.log}: no step records")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(s["t"] for s in steps + decisions)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for side, color in (("prefill", "tab:orange"), ("decode", "tab:blue")):
        mine = [s for s in steps if s["side"] == side]
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
            ax2.axvline(d["t"] - t0, color="tab:red" if d["reason"] == "balance" else "tab:gray", lw=0.3, alpha=0.5)
    queue = ax2.twinx()
    queue.plot([s["t"] - t0 for s in prefill], [s["num_queued"] for s in prefill], color="tab:orange", lw=0.8,
               label="prefill queue")
    queue.plot([s["t"] - t0 for s in decode], [s["num_seqs"] for s in decode], color="tab:green", lw=0.8,
               label="decode batch")
    queue.set_ylabel("requests")
    handles = ax2.get_legend_handles_labels()[0] + queue.get_legend_handles_labels()[0]
    ax2.legend(handles, [h.get_label() for h in handles], loc="upper right")
    done = switches(args.log)
    if done:
        print(f"switches: {len(done)}, decision to both sides on the new split p50 {_q(done, 0.5):.3f} ms, "
              f"p99 {_q(done, 0.99):.3f} ms")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
