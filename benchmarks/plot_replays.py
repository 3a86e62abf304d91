"""SLO attainment against the arrival rate, one panel per served run: what was measured, and what
`benchmarks.replay_split` replayed for each setting it was given (e.g. `--prefill-order least_slack` and
`max_on_time`). A picture of a replay table: a model, not a measurement, and the figure says so.

    python -m benchmarks.plot_replays benchmarks/results/replay_order_mot_h200/split --out split.png

Reads every replay_split JSON (`--json`) in the folder; groups them by the served run's folder (the parent of
its runs/), the rate (from the run file's name) and the setting (`--label-by`, a key of the JSON: prefill_order by
default). Prints the table it draws.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.rescore import RUN_FILE_NAME


def load_points(folder: Path, label_by: str = "prefill_order") -> dict[str, dict[str, dict[float, float]]]:
    """{served run: {setting or "measured": {rate: attainment}}} from the replay_split JSONs in `folder` (each scored
    under its own `--slo`, strict unless it names another: slo_of)."""
    points: dict[str, dict[str, dict[float, float]]] = defaultdict(lambda: defaultdict(dict))
    files = sorted(folder.glob("*.json"))
    if not files:
        raise SystemExit(f"{folder}: no replay_split JSON (--json) here")
    for path in files:
        try:
            doc: dict[str, Any] = json.loads(path.read_text())
            m = RUN_FILE_NAME.match(Path(str(doc["run"])).name)
            rows = doc["rows"]
        except (ValueError, KeyError, TypeError) as e:
            raise SystemExit(f"{path.name}: not a replay_split result ({type(e).__name__}: {e})") from e
        if m is None or len(rows) != 1:
            raise SystemExit(f"{path.name}: need one row (one margin and scope) of a run file named *-rate<R>.json[.gz]")
        run = Path(str(doc["run"])).parent.parent
        served = f"{run.parent.name}/{run.name}"
        rate = float(m["rate"])
        points[served]["measured"][rate] = float(doc["measured"]["attainment"])
        points[served][str(doc.get(label_by, "?"))][rate] = float(rows[0]["attainment"]["mean"])
    return points


def table(points: dict[str, dict[str, dict[float, float]]]) -> str:
    lines = ["| served run | rate (req/s) | " + " | ".join(_labels(points)) + " |",
             "|---|---|" + "---|" * len(_labels(points))]
    for served, series in points.items():
        for rate in sorted({r for s in series.values() for r in s}):
            cells = [f"{series[label][rate]:.1%}" if rate in series.get(label, {}) else "-" for label in _labels(points)]
            lines.append(f"| {served} | {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _labels(points: dict[str, dict[str, dict[float, float]]]) -> list[str]:
    labels = sorted({label for series in points.values() for label in series} - {"measured"})
    return ["measured", *labels]


def slo_of(folder: Path) -> str:
    """The SLO the replays in `folder` were scored under (replay_split's `--slo` / `--score-slo`; strict in results
    written before it had one). Replays scored under different SLOs do not share a figure."""
    names = sorted({str(json.loads(p.read_text()).get("slo", "strict")) for p in folder.glob("*.json")})
    if len(names) > 1:
        raise SystemExit(f"{folder}: replays scored under different SLOs ({', '.join(names)}); one folder per SLO")
    return names[0] if names else "strict"


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path, help="a folder of replay_split JSON results (--json)")
    parser.add_argument("--label-by", default="prefill_order",
                        help="the JSON key whose value names each replayed setting (default prefill_order)")
    parser.add_argument("--out", type=Path, default=None, help="write the figure here (PNG)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        raise SystemExit(f"folder: {args.folder} is not a folder")
    points = load_points(args.folder, args.label_by)
    slo = slo_of(args.folder)
    print(table(points))
    if args.out is not None:
        plot(points, args.out, slo)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
