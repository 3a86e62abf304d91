"""Tables and figures from benchmark results: a markdown summary table, latency CDFs of several runs side by
side, and attainment/throughput/latency against request rate for a sweep of several systems.

    python -m bullet_ray.bench.report results/a.json results/b.json --out results/ab   # table + CDF figure
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bullet_ray.bench.result import BenchResult

logger = logging.getLogger(__name__)


def _fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def _stat(summary: Mapping[str, Any], metric: str) -> str:
    s = summary[metric]
    return " / ".join(_fmt(s[k]) for k in ("mean", "p50", "p90", "p99"))


def summary_markdown(results: Sequence[BenchResult]) -> str:
    """One row per run; latencies as mean / p50 / p90 / p99 in ms; attainment per SLO scored."""
    slo_names = list(dict.fromkeys(name for r in results for name in r.summary["slo"]))
    header = ["system", "rate (req/s)", "done/sent", "TTFT ms", "TPOT ms", "ITL ms", "e2e ms", "req/s",
              "out tok/s", "tok/s"] + [f"attain. {n}" for n in slo_names] + [f"good req/s {n}" for n in slo_names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        s = r.summary
        rate = r.config.get("workload", {}).get("rate_rps")
        scale = r.config.get("workload", {}).get("trace_scale")
        rate_txt = _fmt(rate, 2) if rate else (f"trace x{scale:g}" if scale else "all at once")
        row = [r.label, rate_txt, f"{s['num_completed']}/{s['num_requests']}", _stat(s, "ttft_ms"),
               _stat(s, "tpot_ms"), _stat(s, "itl_ms"), _stat(s, "e2e_ms"), _fmt(s["request_throughput_rps"], 2),
               _fmt(s["output_throughput_tps"]), _fmt(s["total_token_throughput_tps"])]
        row += [f"{s['slo'][n]['attainment']:.1%}" if n in s["slo"] else "-" for n in slo_names]
        row += [_fmt(s["slo"][n]["good_request_throughput_rps"], 2) if n in s["slo"] else "-" for n in slo_names]
        lines.append("| " + " | ".join(row) + " |")
    slo_lines = {d["description"] for r in results for d in r.summary["slo"].values()}
    lines += ["", "Latencies: mean / p50 / p90 / p99 over completed requests. ITL = gap between SSE chunks "
              "carrying text. SLOs: " + "; ".join(sorted(slo_lines))]
    return "\n".join(lines)


def _pyplot() -> Any:
    from bullet_ray.bench import require_extra

    matplotlib = require_extra("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(results: Sequence[BenchResult], path: str | Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and e2e latency (ms), one line per run."""
    import numpy as np

    plt = _pyplot()
    metrics = [("TTFT", lambda r: [x.ttft_s for x in r.records if x.success]),
               ("TPOT", lambda r: [x.tpot_s for x in r.records if x.success and x.tpot_s is not None]),
               ("ITL (per chunk)", lambda r: [g for x in r.records if x.success for g in x.itl_s]),
               ("e2e", lambda r: [x.e2e_s for x in r.records if x.success])]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, (name, values) in zip(axes, metrics):
        for r in results:
            v = np.sort(np.asarray(values(r), dtype=float)) * 1000
            if len(v):
                ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=r.label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests" if name != "ITL (per chunk)" else "share of chunks")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(_title(results))
    fig.tight_layout()
    return _save(fig, plt, path)


def _title(results: Sequence[BenchResult]) -> str:
    if not results:
        return ""
    w = results[0].config.get("workload", {})
    return f"{w.get('dataset')} (seed {w.get('seed')}), model {results[0].config.get('model')}"


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_sweep(sweep: Mapping[str, Sequence[Mapping[str, Any]]], slo_name: str, path: str | Path,
               goodputs: Mapping[str, Mapping[str, Any]] | None = None, title: str = "") -> Path:
    """Per system, over the swept rates: attainment under `slo_name` (goodput marked), throughput, p90 TTFT
    and p90 TPOT. sweep[system] = [{"rate_rps": r, "summary": {...}}, ...]."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for system, points in sweep.items():
        pts = sorted((p for p in points if p["summary"]["num_requests"]), key=lambda p: p["rate_rps"])
        rates = [p["rate_rps"] for p in pts]
        att = [p["summary"]["slo"][slo_name]["attainment"] * 100 for p in pts]
        (line,) = axes[0].plot(rates, att, marker="o", label=system)
        gp = (goodputs or {}).get(system)
        if gp and gp.get("interpolated_rps"):
            axes[0].axvline(gp["interpolated_rps"], color=line.get_color(), ls=":", alpha=0.7)
        axes[1].plot(rates, [p["summary"]["output_throughput_tps"] for p in pts], marker="o", label=system)
        axes[2].plot(rates, [p["summary"]["ttft_ms"]["p90"] for p in pts], marker="o", label=system)
        axes[3].plot(rates, [p["summary"]["tpot_ms"]["p90"] for p in pts], marker="o", label=system)
    axes[0].axhline(90, color="grey", ls="--", lw=1)
    labels = [f"SLO attainment (%), {slo_name}", "output tokens/s", "p90 TTFT (ms)", "p90 TPOT (ms)"]
    for ax, label in zip(axes, labels):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 102)
    axes[0].legend(fontsize=8)
    fig.suptitle(title or f"rate sweep; dotted: goodput (interpolated) under {slo_name}")
    fig.tight_layout()
    return _save(fig, plt, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.bench.report",
                                     description="Summary table and latency CDFs of saved runs, side by side.")
    parser.add_argument("results", nargs="+", help="result JSON files written by serve_bench")
    parser.add_argument("--out", default=None, help="write OUT.md and OUT-cdf.png (default: print the table)")
    args = parser.parse_args(argv)
    results = [BenchResult.load(p) for p in args.results]
    table = summary_markdown(results)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.md").write_text(table + "\n")
        print(plot_latency_cdfs(results, f"{args.out}-cdf.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
