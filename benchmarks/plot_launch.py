"""Host launch time against device time of the steps with prompt tokens, for chunked step logs side by side
(e.g. piecewise CUDA graphs on and off in one serving run).

    python -m benchmarks.plot_launch eager=chunked-2048-nopw-steps.jsonl.gz piecewise=chunked-2048-steps.jsonl.gz \
        --out launch.png

One panel per log: each prefill or mixed step's `launch_ms` (the host enqueueing the step) and `measured_ms`
(its device time, CUDA events) against its tokens. Where the two lie together the step is launch-bound: the
GPU waits for the host. Prints the medians per token range (the table of the results README), and per kind of
forward (decode graph, piecewise, eager) the medians of every part of the launch the log holds (`prep_ms`,
`attn_plan_ms`, `replay_ms`, `attention_ms`, `forward_ms`, `sample_ms`; step logs since the eighth session),
and of the steps without prompt tokens their sequences, context tokens and device time; and the launches that
waited for the GPU inside (`blocked_launches`).
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.plot_steps import records

RANGES = ((1, 64), (64, 512), (512, 1024), (1024, 1600), (1600, 2049))


def prompt_steps(path: str) -> list[dict]:
    """The log's prefill and mixed steps (decode-only steps replay one graph either way)."""
    return [r for r in records(path) if r.get("kind") == "step" and r.get("phase") in ("prefill", "mixed")]


def medians(steps: list[dict]) -> list[dict]:
    """Per token range: steps, median tokens, launch_ms and measured_ms."""
    rows = []
    for lo, hi in RANGES:
        part = [s for s in steps if lo <= s["num_tokens"] < hi and "launch_ms" in s]
        if part:
            rows.append({"tokens": f"{lo}-{hi - 1}", "steps": len(part),
                         "launch_ms": round(statistics.median(s["launch_ms"] for s in part), 1),
                         "measured_ms": round(statistics.median(s["measured_ms"] for s in part), 1)})
    return rows


PARTS = ("prep_ms", "attn_plan_ms", "replay_ms", "attention_ms", "forward_ms", "sample_ms", "launch_ms",
         "measured_ms")


def parts_by_graphs(path: str) -> dict[str, dict[str, float]]:
    """Every step of the log by how its forward ran (`graphs`: decode, piecewise, eager): how many, and the
    median of each part of the host's launch the step log holds (runner.InFlightStep.host_s) and of its
    device time."""
    by_kind: dict[str, list[dict]] = {}
    for r in records(path):
        if r.get("kind") == "step" and "graphs" in r:
            by_kind.setdefault(r["graphs"], []).append(r)
    out: dict[str, dict[str, float]] = {}
    for kind, steps in sorted(by_kind.items()):
        row: dict[str, float] = {"steps": len(steps)}
        for part in PARTS:
            values = [s[part] for s in steps if part in s]
            if values:
                row[part] = round(statistics.median(values), 2)
        out[kind] = row
    return out


def decode_only_by_graphs(path: str) -> dict[str, dict[str, float]]:
    """The log's steps without prompt tokens by how their forward ran: how many, and the medians of their
    sequences, context tokens and device time (a decode batch above the largest decode graph runs through
    piecewise graphs, or eagerly)."""
    by_kind: dict[str, list[dict]] = {}
    for r in records(path):
        if r.get("kind") == "step" and "graphs" in r and r.get("num_prefill_seqs") == 0:
            by_kind.setdefault(r["graphs"], []).append(r)
    return {kind: {"steps": len(steps), **{key: round(statistics.median(s[key] for s in steps), 2)
                                           for key in ("num_seqs", "num_context_tokens", "measured_ms")}}
            for kind, steps in sorted(by_kind.items())}


# the launch's consecutive parts (runner.InFlightStep.host_s): the inputs, the forward enqueued (its attention
# plan, graph replays and eager attention inside it), then the sampling, split into its parts where the log has them
LAUNCH_PARTS = ("prep_ms", "forward_ms", "sample_ms")
SAMPLE_PARTS = ("sample_rows_ms", "logits_ms", "sampler_ms", "to_host_ms")


def blocked_launches(path: str, share: float = 0.7, min_ms: float = 20.0) -> dict[str, object]:
    """Steps whose launch held the host for >= `share` of their own device time (and >= `min_ms`): with
    launch-ahead the host should enqueue a step long before the GPU finishes the one before, so a launch that
    long waited for the GPU inside (a synchronizing call: e.g. an allocator that must grow, or an eager step's
    full launch queue), and the GPU then idles while the host plans and prepares the next step. Layer-wise steps
    (`layer_groups` > 1) wait between their groups by design and are left out. How many, by phase, the part of
    the launch that took longest (`sample_ms` split into its parts from the twenty-second session on), and the
    host time before the same side's next step's forward (its gap, inputs and attention plan: the idle GPU's
    upper bound), summed."""
    steps = sorted((r for r in records(path) if r.get("kind") == "step" and "launch_ms" in r
                    and r.get("layer_groups", 1) == 1), key=lambda r: r["t"])
    blocked, by_phase, by_part, idle_ms = [], {}, {}, 0.0
    for i, r in enumerate(steps):
        if r["launch_ms"] < max(min_ms, share * r["measured_ms"]):
            continue
        blocked.append(r)
        by_phase[r["phase"]] = by_phase.get(r["phase"], 0) + 1
        names = [k for k in LAUNCH_PARTS if k != "sample_ms"] + list(SAMPLE_PARTS if "logits_ms" in r else ["sample_ms"])
        parts = [k for k in names if k in r]
        worst = max(parts, key=lambda k: r[k]) if parts else "?"
        by_part[worst] = by_part.get(worst, 0) + 1
        nxt = next((n for n in steps[i + 1:] if n.get("side") == r.get("side")), None)
        if nxt is not None:
            idle_ms += sum(nxt.get(k, 0.0) for k in ("gap_ms", "prep_ms", "attn_plan_ms"))
    return {"steps": len(steps), "blocked": len(blocked), "by_phase": by_phase, "longest_part": by_part,
            "next_host_ms_sum": round(idle_ms, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("logs", nargs="+", help="NAME=step-log.jsonl[.gz], one panel each")
    parser.add_argument("--out", default="launch.png")
    args = parser.parse_args(argv)
    named = []
    for item in args.logs:
        name, sep, path = item.partition("=")
        if not sep:
            parser.error(f"logs: {item!r} is not NAME=PATH")
        named.append((name, prompt_steps(path)))
    for (name, steps), item in zip(named, args.logs):
        print(name)
        for row in medians(steps):
            print(f"  {row['tokens']:>9} tokens  {row['steps']:4d} steps  launch {row['launch_ms']:5.1f} ms  "
                  f"device {row['measured_ms']:5.1f} ms")
        for kind, row in parts_by_graphs(item.partition("=")[2]).items():
            print(f"  {kind} steps, medians: " + ", ".join(f"{k} {v:g}" for k, v in row.items()))
        for kind, row in decode_only_by_graphs(item.partition("=")[2]).items():
            print(f"  {kind} steps without prompt tokens, medians: " + ", ".join(f"{k} {v:g}" for k, v in row.items()))
        held = blocked_launches(item.partition("=")[2])
        print(f"  launches that waited for the GPU (>= 70% of their own device time): {held['blocked']} of "
              f"{held['steps']} steps, by phase {held['by_phase']}, longest part {held['longest_part']}; the next "
              f"steps' host time before their forward {held['next_host_ms_sum']} ms in all")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(named), figsize=(5.5 * len(named), 4.2), sharey=True, squeeze=False)
    for ax, (name, steps) in zip(axes[0], named):
        tokens = [s["num_tokens"] for s in steps]
        ax.scatter(tokens, [s["measured_ms"] for s in steps], s=6, alpha=0.5, label="device time (CUDA events)")
        ax.scatter(tokens, [s.get("launch_ms", 0.0) for s in steps], s=6, alpha=0.5, label="host launch")
        ax.set_title(f"{name}: {len(steps)} prefill / mixed steps")
        ax.set_xlabel("tokens in the step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("ms")
    axes[0][0].legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
