"""Score a saved rate sweep against other SLOs: attainment per (system, rate) and goodput per system,
from the per-request results a comparison saved (`runs/<system>-rate<r>.json[.gz]`). Nothing is re-run:
the same requests, judged by other targets (e.g. Bullet's per-prompt-token presets), and why the misses
missed: TTFT only, TPOT only, both, or failed (a rule that trades one target for the other shows here); and for
the TTFT misses, their TTFT range and prompt lengths against those of the requests that met the SLO.

    python -m benchmarks.rescore benchmarks/results/serve_h100_code/runs --slo bullet-azure-code,strict \
        --out benchmarks/results/serve_h100_code/rescore.md
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bullet_ray.bench.slo import SLO, attainment, goodput, parse_slo

MISS_KINDS = ("ttft", "tpot", "both", "failed")
RUN_FILE_NAME = re.compile(r"^(?P<system>.+)-rate(?P<rate>[0-9.]+)\.json(\.gz)?$")


def load_run(path: str | Path) -> dict[str, Any]:
    """One bench tool result (`runs/<system>-rate<r>.json[.gz]`)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def timed_record(request: dict[str, Any]) -> SimpleNamespace:
    """A run file's request as bullet_ray.bench.slo judges it (success, TTFT, TPOT, prompt tokens)."""
    return SimpleNamespace(success=request["success"], ttft_s=request["ttft_s"], tpot_s=request["tpot_s"],
                           prompt_tokens=request["prompt_tokens"])


def load_runs(folder: Path) -> dict[str, dict[float, list[Any]]]:
    """{system: {rate: [request records]}} from a runs folder."""
    out: dict[str, dict[float, list[Any]]] = defaultdict(dict)
    for path in sorted(folder.iterdir()):
        m = RUN_FILE_NAME.match(path.name)
        if not m:
            continue
        doc = load_run(path)
        rate = float(doc["config"]["workload"].get("rate_rps") or m["rate"])
        out[m["system"]][rate] = [timed_record(r) for r in doc["requests"]]
    return out


def _late(r: Any, slo: SLO) -> bool:
    """Whether a request with a first token got it after `slo`'s TTFT target for its prompt."""
    return r.ttft_s > slo.ttft_target_s(r.prompt_tokens)


def miss_kinds(records: list[Any], slo: SLO) -> dict[str, int]:
    """How many of `records` miss `slo`, by why: failed (or no first token), TTFT only, TPOT only, both."""
    kinds = dict.fromkeys(MISS_KINDS, 0)
    for r in records:
        if not r.success or r.ttft_s is None:
            kinds["failed"] += 1
            continue
        late = _late(r, slo)
        slow = r.tpot_s is not None and r.tpot_s > slo.tpot_s
        if late or slow:
            kinds["both" if late and slow else "ttft" if late else "tpot"] += 1
    return kinds


def ttft_misses(records: list[Any], slo: SLO) -> dict[str, Any] | None:
    """The requests that missed `slo` on TTFT (TTFT only or both): how many, their TTFT range (s), and the median
    prompt tokens of theirs against that of the requests that met `slo` (a rule that gives up on long prompts shows
    here); None when none did."""
    late = [r for r in records if r.success and r.ttft_s is not None and _late(r, slo)]
    if not late:
        return None
    met = [r.prompt_tokens for r in records if slo.meets(r)]
    return {"count": len(late), "ttft_s": [round(min(r.ttft_s for r in late), 3), round(max(r.ttft_s for r in late), 3)],
            "prompt_tokens_median": statistics.median(r.prompt_tokens for r in late),
            "met_prompt_tokens_median": statistics.median(met) if met else None}


def rescore(runs: dict[str, dict[float, list[Any]]], slo_names: list[str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for system, by_rate in runs.items():
        entry: dict[str, Any] = {"attainment": {}, "goodput": {}, "misses": {}, "ttft_misses": {}}
        for name in slo_names:
            slo = parse_slo(name)
            points = [(rate, attainment(records, slo)) for rate, records in sorted(by_rate.items())]
            entry["attainment"][name] = {str(rate): round(a, 4) for rate, a in points}
            entry["goodput"][name] = goodput(points, name).to_dict()
            entry["misses"][name] = {str(rate): miss_kinds(records, slo) for rate, records in sorted(by_rate.items())}
            entry["ttft_misses"][name] = {str(rate): ttft_misses(records, slo) for rate, records in sorted(by_rate.items())}
        entry["requests"] = {str(rate): len(records) for rate, records in sorted(by_rate.items())}
        result[system] = entry
    return result


def markdown(result: dict[str, Any], slo_names: list[str]) -> str:
    lines = ["| system | " + " | ".join(f"goodput {n} (req/s)" for n in slo_names) + " |",
             "|---|" + "---|" * len(slo_names)]
    for system, entry in result.items():
        cells = []
        for n in slo_names:
            g = entry["goodput"][n]
            value = g["interpolated_rps"] if g["interpolated_rps"] is not None else g["measured_rps"]
            cells.append(("" if g["is_bracketed"] or not g["measured_rps"] else ">= ") + f"{value:.2f}")
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    lines += ["", "| system | SLO | attainment by rate |", "|---|---|---|"]
    for system, entry in result.items():
        for n in slo_names:
            lines.append(f"| {system} | {n} | " + ", ".join(f"{r}: {a:.1%}" for r, a in entry["attainment"][n].items())
                         + " |")
    lines += ["", "Misses by why (requests): TTFT only / TPOT only / both / failed", "",
              "| system | SLO | rate (req/s) | requests | TTFT only | TPOT only | both | failed |",
              "|---|---|---|---|---|---|---|---|"]
    for system, entry in result.items():
        for n in slo_names:
            for rate, kinds in entry["misses"][n].items():
                lines.append(f"| {system} | {n} | {rate} | {entry['requests'][rate]} | "
                             + " | ".join(str(kinds[k]) for k in MISS_KINDS) + " |")
    lines += ["", "TTFT misses (TTFT only or both): their TTFT, and their prompts against those of the requests that met "
              "the SLO", "", "| system | SLO | rate (req/s) | TTFT misses | their TTFT (s) | prompt tokens, median: missed / "
              "met |", "|---|---|---|---|---|---|"]
    for system, entry in result.items():
        for n in slo_names:
            for rate, m in entry["ttft_misses"][n].items():
                if m is not None:
                    met = "-" if m["met_prompt_tokens_median"] is None else f"{m['met_prompt_tokens_median']:g}"
                    lines.append(f"| {system} | {n} | {rate} | {m['count']} | {m['ttft_s'][0]:.2f}-{m['ttft_s'][1]:.2f} | "
                                 f"{m['prompt_tokens_median']:g} / {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, help="a comparison's runs/ folder")
    parser.add_argument("--slo", default="strict,relaxed", help="SLO presets or custom targets, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="markdown file (a .json beside it)")
    args = parser.parse_args(argv)
    if not args.runs.is_dir():
        print(f"error: runs: {args.runs} is not a folder", file=sys.stderr)
        return 2
    names = args.slo.split(",")
    try:
        for n in names:
            parse_slo(n)
    except ValueError as e:
        print(f"error: --slo: {e}", file=sys.stderr)
        return 2
    result = rescore(load_runs(args.runs), names)
    text = markdown(result, names)
    print(text)
    if args.out:
        command = "python -m benchmarks.rescore " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.write_text(f"`{command}`\n\n{text}\n")
        args.out.with_suffix(".json").write_text(json.dumps({"command": command, "systems": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
