"""SLO attainment against the arrival rate, one panel per served run: what was measured, and what
`benchmarks.replay_split` replayed for each setting it was given (e.g. `--prefill-order least_slack` and
`max_on_time`). A picture of a replay table: a model, not a measurement, and the figure says so.

    python -m benchmarks.plot_replays benchmarks/results/replay_order_mot_h200/split --out split.png

Reads every replay_split JSON (`--json`) in the folder; groups them by the served run's folder (the parent of
its runs/), the rate (from the run file's name) and the setting (`--label-by`, a key of the JSON: prefill_order by
default). Prints the table it draws, then each run's goodput over the replayed rates, measured and replayed.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.rescore import RUN_FILE_NAME


@dataclass(frozen=True)
class Replay:
    """One replay_split result: a served run (draw folder, system, rate) replayed with one setting."""

    draw: str  # the served folder holding runs/, as "<parent>/<name>"
    system: str  # the served system whose run was replayed
    rate: float
    setting: str  # the replayed setting (the JSON's --label-by key)
    replayed: float  # mean attainment over the replay's noise seeds
    low: float
    high: float
    measured: float  # the replayed run's own served attainment
    slo: str  # the SLO preset both were scored under (replay_split --slo)


def setting_name(value: Any) -> str:
    """How a replayed setting is named in the tables and the legend: its value as given, with an empty split rule
    (`--split-rule '{}'`: the engine's defaults) or a missing one read as "default"."""
    return "default" if value in (None, {}, "") else str(value)


def load(folder: Path, label_by: str = "prefill_order") -> list[Replay]:
    """Every replay_split JSON in `folder`; one SLO for all of them, one file per (run, setting)."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"{folder}: no replay_split JSON (--json) here")
    replays: list[Replay] = []
    seen: dict[tuple[str, str, float, str], str] = {}
    for path in files:
        try:
            doc: dict[str, Any] = json.loads(path.read_text())
            run = Path(str(doc["run"]))
            rows = doc["rows"]
            measured = float(doc["measured"]["attainment"])
            setting = setting_name(doc[label_by])
            att = rows[0]["attainment"]
            replayed, low, high = float(att["mean"]), float(att["min"]), float(att["max"])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise SystemExit(f"{path.name}: not a replay_split result with {label_by!r} "
                             f"({type(e).__name__}: {e})") from e
        m = RUN_FILE_NAME.match(run.name)
        if m is None or len(rows) != 1 or run.parent.name != "runs":
            raise SystemExit(f"{path.name}: need one row (one margin and scope) of a run file <draw>/runs/"
                             f"<system>-rate<R>.json[.gz], got {run}")
        draw = run.parent.parent
        replay = Replay(f"{draw.parent.name}/{draw.name}", m["system"], float(m["rate"]), setting, replayed, low,
                        high, measured, str(doc.get("slo", "strict")))
        key = (replay.draw, replay.system, replay.rate, replay.setting)
        if key in seen:
            raise SystemExit(f"{path.name} and {seen[key]} replay the same run with the same {label_by}")
        seen[key] = path.name
        replays.append(replay)
    slos = sorted({r.slo for r in replays})
    if len(slos) > 1:
        raise SystemExit(f"{folder}: replays scored under different SLOs ({', '.join(slos)}); one folder per SLO")
    return replays


def points_of(replays: list[Replay]) -> dict[str, dict[str, dict[float, float]]]:
    """{served run: {setting or "measured": {rate: attainment}}}; a served run is its draw folder, or
    "<draw>: <system>" where the replays hold several systems of one draw."""
    several = len({(r.draw, r.system) for r in replays}) > len({r.draw for r in replays})
    points: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in replays:
        served = f"{r.draw}: {r.system}" if several else r.draw
        points[served]["measured"][r.rate] = r.measured
        points[served][r.setting][r.rate] = r.replayed
    return points


def table(points: dict[str, dict[str, dict[float, float]]]) -> str:
    lines = ["| served run | rate (req/s) | " + " | ".join(_labels(points)) + " |",
             "|---|---|" + "---|" * len(_labels(points))]
    for served, series in points.items():
        for rate in sorted({r for s in series.values() for r in s}):
            cells = [f"{series[label][rate]:.1%}" if rate in series.get(label, {}) else "-" for label in _labels(points)]
            lines.append(f"| {served} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def goodput_table(points: dict[str, dict[str, dict[float, float]]], slo: str = "strict") -> str:
    """Each served run's goodput (bullet_ray.bench.slo.goodput: the rate where attainment crosses 90%, interpolated
    between the rates on either side) measured and as each setting replays it, over the replayed rates only: ">="
    where the top one still meets 90%, "<" where the lowest does not."""
    from bullet_ray.bench.slo import goodput

    def cell(series: dict[float, float]) -> str:
        g = goodput(series.items(), slo)
        if g.interpolated_rps is None:
            return f"< {min(series):g}" if series else "-"
        return f"{g.interpolated_rps:.2f}" if g.is_bracketed else f">= {g.interpolated_rps:g}"

    labels = _labels(points)
    lines = [f"Goodput over the replayed rates ({slo} SLO, 90% attainment, interpolated; req/s):", "",
             "| served run | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for served, series in points.items():
        lines.append(f"| {served} | " + " | ".join(cell(series[label]) if label in series else "-"
                                                     for label in labels) + " |")
    return "\n".join(lines)


def _labels(points: dict[str, dict[str, dict[float, float]]]) -> list[str]:
    labels = sorted({label for series in points.values() for label in series} - {"measured"})
    return ["measured", *labels]


def plot(points: dict[str, dict[str, dict[float, float]]], out: Path, slo: str = "strict") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(points)
    fig, axes = plt.subplots(1, len(runs), figsize=(3.4 * len(runs), 3.4), sharey=True, squeeze=False)
    for ax, served in zip(axes[0], runs):
        for label in _labels(points):
            series = points[served].get(label)
            if not series:
                continue
            rates = sorted(series)
            style = {"color": "black", "marker": "s", "linestyle": "--"} if label == "measured" else {"marker": "o"}
            ax.plot(rates, [100 * series[r] for r in rates], label=label if label == "measured" else f"replayed: {label}",
                    **style)
        ax.axhline(90, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(served, fontsize=9)
        ax.set_xlabel("arrival rate (req/s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{slo} SLO attainment (%)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle("replayed by a model (benchmarks/replay_split), beside the served run; dotted: 90%", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def folder_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line this module and benchmarks.replay_vs_served share: a folder of replay_split JSONs, the key
    naming each setting, the figure's path."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder of replay_split JSON results (--json)")
    parser.add_argument("--label-by", default="prefill_order",
                        help="the JSON key whose value names each replayed setting (default prefill_order)")
    parser.add_argument("--out", type=Path, default=None, help="write the figure here (PNG)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = folder_parser(__doc__).parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"folder: {args.folder} is not a folder")
    replays = load(args.folder, args.label_by)  # one SLO for all of them (load refuses a mix)
    points = points_of(replays)
    print(table(points))
    print()
    print(goodput_table(points, replays[0].slo))
    if args.out is not None:
        plot(points, args.out, replays[0].slo)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
