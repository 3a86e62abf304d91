"""How sure is a goodput figure? Bootstrap intervals for goodput and for the ratio of two systems' goodputs,
from the per-request results a rate sweep saved (`runs/<system>-rate<R>.json[.gz]`, serve_h100's layout).
Nothing is re-run.

Each resample draws every rate's requests again with replacement (as many as were sent), judges them with the
project's own rule (`SLO.meets` on `RequestRecord`, failed requests are misses), and recomputes attainment per
rate and the interpolated goodput (`bullet_ray.bench.slo.goodput`). Systems are resampled independently, with a
random stream per system from (--seed, its name), so a system's draws do not depend on which others are chosen;
one draw of requests is judged by every SLO. The point estimate is the figure of the unresampled requests (the
one compare.md prints). A goodput the sweep cannot pin down is censored: ">= <max rate>" when the highest swept
rate met the target, "< <min rate>" when no rate did; ratios that involve one are bounds, and P(ratio >= x) is
given as a range when they leave it open.

What it does not see: the requests of one rate are treated as independent draws, but in a run they queue behind
each other (one slow burst slows its neighbours), and a second run of the same system on another machine or
another day differs in more than which requests were sent. The intervals are the spread from sampling
requests, a lower bound on the run-to-run spread.

    python -m benchmarks.goodput_ci benchmarks/results/serve_h100_m2u --slo strict,relaxed \\
        --out benchmarks/results/serve_h100_m2u/goodput_ci.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import sys
import zlib
from dataclasses import MISSING, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.rescore import RUN_FILE_NAME, load_run
from bullet_ray.bench.result import RequestRecord
from bullet_ray.bench.slo import SLO, Goodput, goodput, parse_slo

logger = logging.getLogger(__name__)

PERCENTILES = (2.5, 50.0, 97.5)
_BLOCK = 10_000  # resamples drawn at once
EXACT, ABOVE, BELOW = 0, 1, -1  # censoring of one goodput: pinned between swept rates, >= max rate, < min rate


class InputError(ValueError):
    """Bad input; the message names the field (or file) and is printed as one line."""


@dataclass(frozen=True)
class Sweep:
    """One system's rate sweep: the requests sent at each rate, and where they came from."""

    requests: dict[float, list[RequestRecord]]  # by rate (req/s)
    files: dict[float, Path]

    @property
    def rates(self) -> list[float]:
        return sorted(self.requests)


def _records(path: Path, doc: dict[str, Any]) -> list[RequestRecord]:
    requests = doc.get("requests")
    if not isinstance(requests, list):
        raise InputError(f"{path.name}: requests: missing or not a list")
    required = [f.name for f in fields(RequestRecord) if f.default is MISSING and f.default_factory is MISSING]
    records = []
    for i, r in enumerate(requests):
        missing = [n for n in required if n not in r] if isinstance(r, dict) else ["(not a dict)"]
        if missing:
            raise InputError(f"{path.name}: requests[{i}]: missing {', '.join(missing)}")
        records.append(RequestRecord.from_dict(r))
    return records


def load_sweeps(folder: Path) -> dict[str, Sweep]:
    """{system: Sweep} from a results folder (or its runs/ folder). Raises InputError on bad input."""
    if not folder.is_dir():
        raise InputError(f"DIR: {folder} is not a folder")
    runs = folder / "runs" if (folder / "runs").is_dir() else folder
    found: dict[str, Sweep] = {}
    for path in sorted(runs.iterdir()):
        m = RUN_FILE_NAME.match(path.name)
        if not m:
            continue
        try:
            doc = load_run(path)
        except (OSError, ValueError, EOFError) as e:
            raise InputError(f"{path.name}: cannot read: {type(e).__name__}: {e}") from e
        if not isinstance(doc, dict):
            raise InputError(f"{path.name}: not a run result (a JSON object with config and requests)")
        workload = (doc.get("config") or {}).get("workload") or {}
        rate = float(workload.get("rate_rps") or m["rate"])
        sweep = found.setdefault(m["system"], Sweep({}, {}))
        if rate in sweep.requests:
            raise InputError(f"{path.name}: rate: {m['system']} at {rate:g} req/s also in {sweep.files[rate].name}")
        sweep.requests[rate] = _records(path, doc)
        sweep.files[rate] = path
    if not found:
        raise InputError(f"DIR: no run files (<system>-rate<R>.json[.gz]) in {runs}")
    return found


def met_by_rate(sweep: Sweep, slo: SLO) -> dict[float, np.ndarray]:
    """Per rate, whether each request met `slo` (the project's SLO.meets)."""
    return {rate: np.array([slo.meets(r) for r in records], dtype=bool) for rate, records in sweep.requests.items()}


def censoring(g: Goodput) -> tuple[float, int]:
    """(value, EXACT/ABOVE/BELOW): the interpolated goodput, or the max rate when no swept rate missed (>=),
    or 0 when none met the target (compare.md's '0.00 / -')."""
    if g.interpolated_rps is None:
        return 0.0, BELOW
    return g.interpolated_rps, EXACT if g.is_bracketed else ABOVE


def bootstrap(sweeps: dict[str, Sweep], slos: list[SLO], num_resamples: int, seed: int,
              is_progress_shown: bool = True) -> dict[str, dict[str, dict[str, Any]]]:
    """{system: {slo: {point: Goodput, values: (B,) array, codes: (B,) censoring}}}."""
    # attainment per (system, slo, rate) for every resample, drawn once per system and rate for all SLOs
    attain: dict[str, dict[str, dict[float, np.ndarray]]] = {}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for system, sweep in sweeps.items():
        rng = np.random.default_rng([seed, zlib.crc32(system.encode())])
        met = {slo.name: met_by_rate(sweep, slo) for slo in slos}
        attain[system] = {slo.name: {} for slo in slos}
        for rate in sweep.rates:
            n = len(sweep.requests[rate])
            for slo in slos:
                attain[system][slo.name][rate] = np.zeros(num_resamples)
            for start in range(0, num_resamples if n else 0, _BLOCK):  # blocks bound the index array's memory
                idx = rng.integers(0, n, size=(min(_BLOCK, num_resamples - start), n))
                for slo in slos:
                    attain[system][slo.name][rate][start:start + len(idx)] = met[slo.name][rate][idx].mean(axis=1)
        out[system] = {slo.name: {"point": goodput([(r, float(m.mean()) if len(m) else 0.0)
                                                     for r, m in met[slo.name].items()], slo.name),
                                  "values": np.zeros(num_resamples), "codes": np.zeros(num_resamples, dtype=int)}
                       for slo in slos}
    from tqdm import tqdm

    for b in tqdm(range(num_resamples), desc="resamples", unit="resample", delay=1.5, file=sys.stderr,
                  disable=not is_progress_shown):
        for system, by_slo in attain.items():
            for name, by_rate in by_slo.items():
                g = goodput([(rate, float(a[b])) for rate, a in by_rate.items()], name)
                entry = out[system][name]
                entry["values"][b], entry["codes"][b] = censoring(g)
    return out


def fmt_rate(value: float, code: int, rates: list[float]) -> str:
    if code == ABOVE:
        return f">= {rates[-1]:.2f}"
    if code == BELOW:
        return f"< {rates[0]:.2f}"
    return f"{value:.2f}"


def goodput_summary(entry: dict[str, Any], rates: list[float]) -> dict[str, Any]:
    """Point estimate, median and 2.5/97.5 percentiles (sample values, so a censored one stays labelled)."""
    values, codes = entry["values"], entry["codes"]
    point_value, point_code = censoring(entry["point"])
    out: dict[str, Any] = {"point": {"value": point_value, "censored": _CENSORED[point_code],
                                     "label": fmt_rate(point_value, point_code, rates),
                                     "goodput": entry["point"].to_dict()}}
    for q in PERCENTILES:
        v = float(np.percentile(values, q, method="inverted_cdf"))
        code = ABOVE if v >= rates[-1] else BELOW if v == 0.0 else EXACT
        out[f"p{q:g}"] = {"value": v, "censored": _CENSORED[code], "label": fmt_rate(v, code, rates)}
    out["share_censored_above"] = float(np.mean(codes == ABOVE))
    out["share_never_met"] = float(np.mean(codes == BELOW))
    return out


_CENSORED = {EXACT: None, ABOVE: "above", BELOW: "below"}


def _bounds(values: np.ndarray, codes: np.ndarray, rates: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Where each resample's true goodput can lie: [v, v], [max rate, inf) or [0, min rate)."""
    lo = np.where(codes == ABOVE, rates[-1], np.where(codes == BELOW, 0.0, values))
    hi = np.where(codes == ABOVE, np.inf, np.where(codes == BELOW, rates[0], values))
    return lo, hi


def ratio_summary(a: dict[str, Any], b: dict[str, Any], rates_a: list[float], rates_b: list[float],
                  thresholds: list[float]) -> dict[str, Any]:
    """a / b per resample: point, median, 2.5/97.5 percentiles of the figures compare.md would print (a censored
    goodput at its bound), and per threshold P(ratio >= x) with the range censoring leaves open."""
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = a["values"] / b["values"]
        a_lo, a_hi = _bounds(a["values"], a["codes"], rates_a)
        b_lo, b_hi = _bounds(b["values"], b["codes"], rates_b)
        ratio_lo, ratio_hi = a_lo / b_hi, a_hi / b_lo
        pa, pb = censoring(a["point"])[0], censoring(b["point"])[0]
        point = pa / pb if pb else (np.inf if pa else np.nan)
    defined = ratio[~np.isnan(ratio)]
    out: dict[str, Any] = {"point": _num(point)}
    for q in PERCENTILES:
        out[f"p{q:g}"] = _num(np.percentile(defined, q, method="inverted_cdf")) if len(defined) else None
    out["share_censored"] = float(np.mean((a["codes"] != EXACT) | (b["codes"] != EXACT)))
    out["num_undefined"] = int(len(ratio) - len(defined))  # both never met: 0 / 0
    out["p_ratio_ge"] = {f"{x:g}": {"p": float(np.mean(ratio >= x)), "p_min": float(np.mean(ratio_lo >= x)),
                                    "p_max": float(np.mean(~(ratio_hi < x)))} for x in thresholds}
    return out


def _num(x: float) -> float | str | None:
    """JSON has no inf/nan: inf as the string "inf", nan as None."""
    x = float(x)
    return None if np.isnan(x) else "inf" if np.isinf(x) else x


def _fmt_ratio(x: float | str | None) -> str:
    return "-" if x is None else "inf" if x == "inf" else f"{x:.2f}x"


def _fmt_p(p: dict[str, float]) -> str:
    if p["p_max"] - p["p_min"] < 1e-12:
        return f"{p['p']:.3f}"
    return f"{p['p']:.3f} ({p['p_min']:.3f}-{p['p_max']:.3f})"


def parse_pairs(text: str | None, systems: list[str]) -> list[tuple[str, str]]:
    if not text:
        return list(itertools.combinations(systems, 2))
    pairs = []
    for item in text.split(","):
        a, sep, b = item.strip().partition("/")
        if not sep or not a or not b:
            raise InputError(f"--pairs: {item!r}: expected A/B")
        for name in (a, b):
            if name not in systems:
                raise InputError(f"--pairs: unknown system {name!r}; known: {', '.join(systems)}")
        pairs.append((a, b))
    return pairs


def check_compare_json(folder: Path, doc_systems: dict[str, Any]) -> dict[str, Any] | None:
    """The point estimates against the folder's compare.json (None if there is none): they must be equal."""
    path = folder / "compare.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text()).get("systems", {})
    mismatches = []
    num_checked = 0
    for system, by_slo in doc_systems.items():
        for name, s in by_slo.items():
            g = saved.get(system, {}).get("goodput", {}).get(name)
            if g is None:
                continue
            num_checked += 1
            mine = s["point"]["goodput"]
            if mine["measured_rps"] != g["measured_rps"] or mine["interpolated_rps"] != g["interpolated_rps"]:
                mismatches.append(f"{system} {name}: {mine['interpolated_rps']} vs {g['interpolated_rps']}")
    return {"file": str(path), "num_checked": num_checked, "mismatches": mismatches}


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"Goodput (req/s) with bootstrap intervals: {doc['num_resamples']} resamples of each rate's requests "
             f"(seed {doc['seed']}); point = the unresampled figure (compare.md's).", "",
             "| system | SLO | point | median | 95% interval | P(>= max rate) | P(never met) |", "|---|---|---|---|---|---|---|"]
    for system, by_slo in doc["systems"].items():
        for name, s in by_slo.items():
            lines.append(f"| {system} | {name} | {s['point']['label']} | {s['p50']['label']} | "
                         f"{s['p2.5']['label']} - {s['p97.5']['label']} | {s['share_censored_above']:.3f} | "
                         f"{s['share_never_met']:.3f} |")
    thresholds = list(doc["pairs"][0]["p_ratio_ge"]) if doc["pairs"] else []
    if doc["pairs"]:
        lines += ["", "Ratio a / b, each system resampled independently:", "",
                  "| a / b | SLO | point | median | 95% interval | " + " | ".join(f"P(ratio >= {x})" for x in thresholds)
                  + " | censored |", "|---|---|---|---|---|" + "---|" * (len(thresholds) + 1)]
        for p in doc["pairs"]:
            lines.append(f"| {p['a']} / {p['b']} | {p['slo']} | {_fmt_ratio(p['point'])} | {_fmt_ratio(p['p50'])} | "
                         f"{_fmt_ratio(p['p2.5'])} - {_fmt_ratio(p['p97.5'])} | "
                         + " | ".join(_fmt_p(p["p_ratio_ge"][x]) for x in thresholds) + f" | {p['share_censored']:.3f} |")
        lines += ["", "censored = share of resamples where either goodput was '>= max rate' or '< min rate'; there the "
                  "ratio uses the bound and P(ratio >= x) is a range (min - max) when the bound leaves it open."]
    check = doc.get("compare_json_check")
    if check is not None:
        lines += ["", f"Point estimates against {Path(check['file']).name}: {check['num_checked']} checked, "
                  + ("all equal." if not check["mismatches"] else "MISMATCH: " + "; ".join(check["mismatches"]))]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.goodput_ci", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="a results folder with runs/<system>-rate<R>.json[.gz] (or runs/ itself)")
    parser.add_argument("--slo", default="strict,relaxed", help="SLO presets or custom targets, comma-separated")
    parser.add_argument("--systems", default=None, help="comma-separated systems (default: every one in runs/)")
    parser.add_argument("--pairs", default=None, help="ratios to report, A/B comma-separated (default: every pair)")
    parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--goal", default=None, help="also report P(ratio >= GOAL); comma-separated, e.g. 1.2,1.25")
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write (a .txt with the table beside it)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def run(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """The whole report as a dict (InputError on bad input)."""
    if args.seed < 0:
        raise InputError(f"--seed: {args.seed}; give 0 or more")
    if args.resamples < 1:
        raise InputError(f"--resamples: {args.resamples}; give at least 1")
    try:
        slos = [parse_slo(s) for s in args.slo.split(",") if s]
    except ValueError as e:
        raise InputError(f"--slo: {e}") from e
    if not slos:
        raise InputError("--slo: empty; give e.g. strict,relaxed")
    sweeps = load_sweeps(args.dir)
    if args.systems:
        names = [s.strip() for s in args.systems.split(",") if s.strip()]
        unknown = [n for n in names if n not in sweeps]
        if unknown:
            raise InputError(f"--systems: unknown system {unknown[0]!r}; known: {', '.join(sweeps)}")
        sweeps = {n: sweeps[n] for n in names}
    pairs = parse_pairs(args.pairs, list(sweeps))
    try:
        goals = [float(x) for x in args.goal.split(",") if x.strip()] if args.goal else []
    except ValueError as e:
        raise InputError(f"--goal: {args.goal!r}: expected numbers, e.g. 1.2,1.25") from e
    if any(not g > 0 for g in goals):
        raise InputError(f"--goal: {args.goal!r}: ratios must be > 0")
    thresholds = [1.0] + [g for g in goals if g != 1.0]
    boot = bootstrap(sweeps, slos, args.resamples, args.seed, not args.no_progress)
    systems = {system: {name: goodput_summary(entry, sweeps[system].rates) for name, entry in by_slo.items()}
               for system, by_slo in boot.items()}
    doc: dict[str, Any] = {
        "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "inputs": {"dir": str(args.dir), "runs": [
            {"system": system, "rate_rps": rate, "file": str(path), "num_requests": len(sweep.requests[rate]),
             "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            for system, sweep in sweeps.items() for rate, path in sorted(sweep.files.items())]},
        "num_resamples": args.resamples, "seed": args.seed, "goals": goals,
        "slos": [slo.to_dict() for slo in slos], "systems": systems,
        "pairs": [{"a": a, "b": b, "slo": slo.name,
                   **ratio_summary(boot[a][slo.name], boot[b][slo.name], sweeps[a].rates, sweeps[b].rates,
                                   thresholds)}
                  for slo in slos for a, b in pairs],
    }
    doc["compare_json_check"] = check_compare_json(args.dir, systems)
    return doc


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    command = "python -m benchmarks.goodput_ci " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        doc = run(args, command)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(doc)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        args.out.with_suffix(".txt").write_text(f"`{command}` ({doc['date']})\n\n{text}\n")
    check = doc["compare_json_check"]
    return 1 if check is not None and check["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
