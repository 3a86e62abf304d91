"""Goodput ratios over several samples of one comparison: each serving folder's point, then the mean.

One serving run is one draw of the workload: `benchmarks/results/replay_split_h200/` showed one run's rate can sit
15+ points of attainment from its setting's mean, and the margin's strict ratio over chunked-2048 has read 1.26x,
1.22x, 1.08x and 1.25x in four samples. A goal is judged on the mean of the samples, not on the best one. This
reads each folder's `goodput_ci.json` (`python -m benchmarks.goodput_ci DIR`; the point figure is compare.md's)
and prints, for system A over each system B and each SLO, the ratio of the points in every sample, their mean,
whether the mean meets the goal, and how far the draws let the mean be trusted: the one-sided 95% lower bound of
the mean (Student's t over the samples' ratios, n - 1 degrees of freedom; each sample one independent draw, its
within-draw noise part of the spread between draws), and whether that bound meets the goal too.

    python -m benchmarks.samples benchmarks/results/serve_h200_m3a benchmarks/results/serve_h200_m3b/seed0 \\
        benchmarks/results/serve_h200_m3b/seed1 benchmarks/results/serve_h200_m3c/seed0 \\
        --a bullet-slo-margin50+direct --b chunked-2048+direct,vllm --slo strict,relaxed --goal 1.25,1.2

Two folders that served the same draw (the same dataset, seed and number of prompts in their compare.json) are
named under the table: the lower bound takes every sample as an independent draw, which two runs of one draw are not.

`--plot PNG` draws the table: one panel per SLO, each sample's ratio per B (a censored one as a hollow triangle at
its bound, pointing the way the bound leaves it open), each B's mean, its lower bound and its goal as lines.

`--alias NAME=AS` reads a system named NAME as AS in every folder (repeatable), so a draw whose systems ran under
another name for the same deployment joins the others (m17's seed 11 ran the shipped system with its `+ragged`
suffix, the default since): a folder holding both names is refused, and the table names every alias used.

`--goal` gives one goal per B, in order. A sample where either point is censored ('>= max rate' or '< min rate')
or missing is listed and left out of the mean, with the reason. Where the censoring bounds the ratio (A above
the sweep's top rate or B below its lowest: at least; the other way round: at most), the bound is shown, and a
second mean takes each such sample at its bound: a lower (upper) bound of the mean when every bound is a lower
(upper) one.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any


def load_points(folder: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """{system: {slo: {"value": float | None, "censored": str | None}}} from folder/goodput_ci.json."""
    path = folder / "goodput_ci.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no goodput_ci.json (run python -m benchmarks.goodput_ci {folder})")
    data = json.loads(path.read_text())
    return {system: {slo: {"value": v["point"]["value"], "censored": v["point"]["censored"],
                           "label": v["point"].get("label")}
                     for slo, v in by_slo.items()}
            for system, by_slo in data["systems"].items()}


def apply_aliases(points: dict[str, dict[str, dict[str, Any]]], aliases: dict[str, str],
                  folder: str) -> tuple[dict[str, dict[str, dict[str, Any]]], list[str]]:
    """`points` with every system named in `aliases` renamed to its alias, and the names renamed; a ValueError
    when a folder holds a system and another aliased to the same name."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    renamed: list[str] = []
    for system, by_slo in points.items():
        name = aliases.get(system, system)
        if name in out:
            raise ValueError(f"{folder}: both {system!r} and another system read as {name!r} (--alias)")
        out[name] = by_slo
        if name != system:
            renamed.append(system)
    return out, renamed


def workload_draw(folder: Path) -> tuple[Any, ...] | None:
    """(dataset, seed, prompts) of the workload folder/compare.json served: one draw of the trace; None without it."""
    path = folder / "compare.json"
    try:
        workload = json.loads(path.read_text())["config"]["workload"]
        return workload["dataset"], workload["seed"], workload["num_prompts"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return None


def same_draws(folders: list[Path]) -> list[tuple[list[int], tuple[Any, ...]]]:
    """([sample numbers, 1-based], draw) for every draw more than one folder served."""
    by_draw: dict[tuple[Any, ...], list[int]] = {}
    for i, folder in enumerate(folders):
        draw = workload_draw(folder)
        if draw is not None:
            by_draw.setdefault(draw, []).append(i + 1)
    return [(numbers, draw) for draw, numbers in by_draw.items() if len(numbers) > 1]


def _censored_rate(point: dict[str, Any]) -> tuple[str, float] | None:
    """("<", r) for a point below the sweep's lowest rate r, (">=", r) for one at or above its top rate; None when
    the point's label does not say (goodput_ci labels them '< 24.00' and '>= 48.00')."""
    m = re.fullmatch(r"\s*(<|>=)\s*([0-9.]+)\s*", point.get("label") or "")
    return (m.group(1), float(m.group(2))) if m else None


def ratio_bound(pa: dict[str, Any], pb: dict[str, Any]) -> dict[str, Any] | None:
    """What A/B is at least ("lower") or at most ("upper") when one or both points are censored; None if open."""
    ca, cb = (_censored_rate(p) if p["censored"] else None for p in (pa, pb))
    if (pa["censored"] and ca is None) or (pb["censored"] and cb is None):
        return None
    a = ca[1] if ca else pa["value"]
    b = cb[1] if cb else pb["value"]
    if not a or not b:
        return None
    # A's true goodput is below ("<") or above (">=") a; B's likewise; the ratio moves with A and against B
    a_side = {"<": "upper", ">=": "lower", None: None}[ca[0] if ca else None]
    b_side = {"<": "lower", ">=": "upper", None: None}[cb[0] if cb else None]
    sides = {s for s in (a_side, b_side) if s}
    return {"side": sides.pop(), "ratio": a / b} if len(sides) == 1 else None


def sample_ratios(points: list[tuple[str, dict[str, Any]]], a: str, b: str, slo: str) -> list[dict[str, Any]]:
    """Per sample: the ratio A/B of the points, or None with the reason it is left out."""
    out = []
    for name, systems in points:
        pa, pb = systems.get(a, {}).get(slo), systems.get(b, {}).get(slo)
        row: dict[str, Any] = {"sample": name, "a": None, "b": None, "ratio": None, "left_out": None}
        if pa is None or pb is None:
            row["left_out"] = f"{a if pa is None else b} not in this sample"
        elif pa["censored"] or pb["censored"]:
            row["left_out"] = f"censored ({a if pa['censored'] else b}: {pa['censored'] or pb['censored']})"
            row["bound"] = ratio_bound(pa, pb)
        elif not pb["value"]:
            row["left_out"] = f"{b} has no goodput"
        else:
            row.update(a=pa["value"], b=pb["value"], ratio=pa["value"] / pb["value"])
        out.append(row)
    return out


# Student's t, one-sided 95%: T95[df - 1] for df = 1..30 (beyond 30 the last, a little above the normal's 1.645)
T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
       1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def mean_lower_bound(ratios: list[float]) -> float | None:
    """The one-sided 95% lower confidence bound of the mean of `ratios` (Student's t); None under two samples."""
    if len(ratios) < 2:
        return None
    se = statistics.stdev(ratios) / len(ratios) ** 0.5
    return statistics.fmean(ratios) - T95[min(len(ratios) - 1, len(T95)) - 1] * se


def summarize(rows: list[dict[str, Any]], goal: float | None) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rows if r["ratio"] is not None]
    mean = statistics.fmean(ratios) if ratios else None
    lower = mean_lower_bound(ratios)
    bounds = [r["bound"] for r in rows if r.get("bound")]
    sides = {b["side"] for b in bounds}
    with_bounds = None  # the mean with each bounded sample at its bound, when that bounds the mean one way
    if bounds and len(sides) == 1:
        with_bounds = {"side": sides.pop(), "n": len(ratios) + len(bounds),
                       "mean": statistics.fmean(ratios + [b["ratio"] for b in bounds])}
    return {"n": len(ratios), "mean": mean, "min": min(ratios, default=None), "max": max(ratios, default=None),
            "mean_with_bounds": with_bounds, "goal": goal, "mean_lower_95": lower,
            "meets_goal": _meets(goal, mean, with_bounds),
            "lower_95_meets_goal": None if lower is None or goal is None else lower >= goal}


def _meets(goal: float | None, mean: float | None, with_bounds: dict[str, Any] | None) -> bool | None:
    """Whether the mean meets the goal; with no uncensored sample, what the bounded mean decides (every sample at
    least its bound, and that mean over the goal: met; every sample at most its bound, under it: missed), else
    None (open: the sweeps did not reach where the ratio is decided)."""
    if goal is None:
        return None
    if mean is not None:
        return mean >= goal
    if with_bounds is None:
        return None
    if with_bounds["side"] == "lower" and with_bounds["mean"] >= goal:
        return True
    if with_bounds["side"] == "upper" and with_bounds["mean"] < goal:
        return False
    return None


def _verdict(s: dict[str, Any]) -> str:
    """The goal column: the mean's verdict ('met', 'missed', or 'open' where censoring leaves it undecided; 'by the
    bounds' when no sample was uncensored), then its lower bound's."""
    if s["goal"] is None:
        return ""
    met = {True: "met", False: "missed", None: "open"}[s["meets_goal"]]
    if s["mean"] is None and s["meets_goal"] is not None:
        met += " by the censored bounds"
    return f"{s['goal']}x: {met}" + ("" if s["lower_95_meets_goal"] is None
                                     else f"; {'met' if s['lower_95_meets_goal'] else 'missed'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="serving folders, each with a goodput_ci.json")
    parser.add_argument("--a", required=True, help="the system whose ratio is judged")
    parser.add_argument("--b", required=True, help="comma list of the systems it is compared with")
    parser.add_argument("--slo", default="strict,relaxed", help="comma list of SLO names (default strict,relaxed)")
    parser.add_argument("--goal", default="", help="comma list, one goal per --b system (e.g. 1.25,1.2)")
    parser.add_argument("--out", type=Path, help="also write the table and figures as JSON here")
    parser.add_argument("--plot", type=Path, help="also draw the ratios per sample, means, bounds and goals (PNG)")
    parser.add_argument("--alias", action="append", default=[], metavar="NAME=AS",
                        help="read system NAME as AS in every folder (repeatable): the same deployment under "
                             "another name, e.g. a suffix that became the default")
    args = parser.parse_args(argv)
    aliases: dict[str, str] = {}
    for item in args.alias:
        name, sep, alias = item.partition("=")
        if not sep or not name or not alias or name == alias:
            parser.error(f"--alias: expected NAME=AS with two different names, got {item!r}")
        aliases[name] = alias
    bs = [b for b in args.b.split(",") if b]
    slos = [s for s in args.slo.split(",") if s]
    if not bs or not slos:
        parser.error(f"--{'b' if not bs else 'slo'}: name at least one")
    try:
        goals = [float(g) for g in args.goal.split(",") if g]
    except ValueError:
        parser.error(f"--goal: {args.goal!r} is not a comma list of numbers")
    if goals and len(goals) != len(bs):
        parser.error(f"--goal: {len(goals)} goals for {len(bs)} --b systems; give one per system")
    try:
        points, used = [], []
        for f in args.folders:
            folder_points, renamed = apply_aliases(load_points(f), aliases, str(f))
            points.append((str(f), folder_points))
            used += [f"{f}: {name} read as {aliases[name]}" for name in renamed]
    except (FileNotFoundError, KeyError, ValueError, json.JSONDecodeError) as e:
        print(f"samples: {e}", file=sys.stderr)
        return 2
    report: dict[str, Any] = {"command": "python -m benchmarks.samples " + " ".join(sys.argv[1:] if argv is None
                                                                                    else argv), "pairs": [],
                              "aliases_used": used}
    print(f"`{report['command']}`\n")
    print("| A / B | SLO | " + " | ".join(f"sample {i + 1}" for i in range(len(points)))
          + " | mean (n) | mean's 95% lower bound | censored at their bound (n) | goal (mean; its lower bound) |")
    print("|---|---|" + "---|" * len(points) + "---|---|---|---|")
    for i, b in enumerate(bs):
        for slo in slos:
            rows = sample_ratios(points, args.a, b, slo)
            s = summarize(rows, goals[i] if goals else None)
            report["pairs"].append({"a": args.a, "b": b, "slo": slo, "samples": rows, **s})
            cells = [f"{r['ratio']:.3f}x" if r["ratio"] is not None else
                     f"{_bound_text(r['bound']['side'], r['bound']['ratio'])} ({r['left_out']})" if r.get("bound") else f"- ({r['left_out']})"
                     for r in rows]
            mean = f"**{s['mean']:.3f}x** ({s['n']})" if s["mean"] is not None else "- (0)"
            wb = s["mean_with_bounds"]
            bounded = "-" if wb is None else f"{_bound_text(wb['side'], wb['mean'])} ({wb['n']})"
            lower = "-" if s["mean_lower_95"] is None else f"{s['mean_lower_95']:.3f}x"
            print(f"| {args.a} / {b} | {slo} | " + " | ".join(cells) + f" | {mean} | {lower} | {bounded} | {_verdict(s)} |")
    print("\n" + "\n".join(f"sample {i + 1}: {name}" for i, (name, _) in enumerate(points)))
    for line in used:
        print(f"alias: {line}")
    repeats = same_draws(args.folders)
    report["same_draw"] = [{"samples": numbers, "draw": list(draw)} for numbers, draw in repeats]
    for numbers, (dataset, seed, prompts) in repeats:
        print(f"samples {', '.join(map(str, numbers))} served the same draw ({dataset}, seed {seed}, {prompts} prompts): "
              "the lower bound takes them as independent draws, which they are not")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot_pairs(report["pairs"], args.plot)
    return 0


def plot_pairs(pairs: list[dict[str, Any]], path: Path) -> None:
    """One panel per SLO: each B's sample ratios (hollow triangles: censored samples at their bound), its mean (solid),
    the mean's one-sided 95% lower bound (dotted) and its goal (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = list(dict.fromkeys(p["slo"] for p in pairs))
    fig, axes = plt.subplots(1, len(slos), figsize=(6.0 * len(slos), 5.6), squeeze=False, sharey=True)
    for ax, slo in zip(axes[0], slos):
        in_panel = [p for p in pairs if p["slo"] == slo]
        for k, p in enumerate(in_panel):
            color = f"C{k}"
            shown = [(i, r["ratio"]) for i, r in enumerate(p["samples"], 1) if r["ratio"] is not None]
            if shown:
                ax.plot(*zip(*shown), "o", color=color, label=f"/ {p['b']}")
            named = bool(shown)  # one legend entry per B: a bound names it only where no measured sample did
            for i, r in enumerate(p["samples"], 1):
                if r.get("bound"):
                    ax.plot(i, r["bound"]["ratio"], "^" if r["bound"]["side"] == "lower" else "v", color=color,
                            mfc="none", ms=8, label=None if named else f"/ {p['b']} (censored: at its bound)")
                    named = True
            if p["mean"] is not None:
                ax.axhline(p["mean"], color=color, lw=1.3, label=f"mean {p['mean']:.3f}x (n={p['n']})")
            if p["mean_lower_95"] is not None:
                ax.axhline(p["mean_lower_95"], color=color, lw=1.0, ls=":",
                           label=f"95% lower bound {p['mean_lower_95']:.3f}x")
            if p["goal"] is not None:
                ax.axhline(p["goal"], color=color, lw=1.0, ls="--", label=f"goal {p['goal']:g}x")
        ax.axhline(1.0, color="0.6", lw=0.7)
        num = max(len(p["samples"]) for p in in_panel)
        ax.set_xticks(range(1, num + 1))
        ax.set_xlabel("sample (one draw of the workload; the table's numbering)")
        ax.set_title(f"{in_panel[0]['a']} / B, {slo}", fontsize=9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            # below the panel: inside it the legend hid the samples under it
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    axes[0][0].set_ylabel("goodput ratio")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bound_text(side: str, value: float) -> str:
    return f"{'>=' if side == 'lower' else '<='} {value:.3f}x"


if __name__ == "__main__":
    raise SystemExit(main())
