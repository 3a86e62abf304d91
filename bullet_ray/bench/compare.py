"""Run one workload (same seed, same requests) against several systems over a sweep of request rates.

A system is a name and a URL. Optionally it is started before its sweep and stopped after it, either by a
shell command (`--launch name="cmd"`, run in its own process group, ready when GET /health or /v1/models
answers 200) or, from Python, by a `lifecycle` context manager (how the lead runs engine schedules such as
bullet / chunked-1024 / chunked-2048 / static as separate server launches). A system may carry a `probe`
(`RateProbe`) read just before and after each rate's measured requests, e.g. a server's Prometheus counters;
what it returns is saved with that rate. Writes one markdown table, one JSON (every point's summary and the
goodput per system) and one figure, plus every run's full JSON.

    python -m bullet_ray.bench.compare --endpoint ours=http://127.0.0.1:8000 --endpoint vllm=http://127.0.0.1:8001 \\
        --dataset azure-conv --rates 1,2,4,8 --num-prompts 500 --slo relaxed --output-dir results/cmp
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from bullet_ray.bench import report
from bullet_ray.bench.result import write_json_atomic
from bullet_ray.bench.serve_bench import (
    BenchConfig,
    BenchResult,
    add_arguments,
    config_from_args,
    run_benchmark,
)
from bullet_ray.bench.slo import goodput, parse_slo
from bullet_ray.bench.traces import RequestSpec, build_workload

logger = logging.getLogger(__name__)

READY_PATHS = ("/health", "/v1/models")


class RateProbe(ABC):
    """Something read from a system around each rate of its sweep (e.g. the server's own metrics).

    Rules: `start` is called after the rate's warm-up requests, just before its measured requests; `finish`
    after the last measured answer, and only if `start` returned. `finish` returns a JSON-able dict, saved as
    `probes[<name>]` in the rate's point (compare.json) and in its run file. Either may raise: the run keeps
    its results and the probe's entry becomes {"error": "<phase>: <Type>: <message>"}. One probe object serves
    one system's whole sweep, one rate at a time.
    """

    name: str = "probe"  # the key under `probes`

    @abstractmethod
    def start(self) -> None:
        """Read the state before the rate's measured requests."""

    @abstractmethod
    def finish(self) -> dict[str, Any]:
        """Read the state after them; return what changed in between."""


@dataclass
class SystemSpec:
    """One system under test. `launch` (a shell command) or `lifecycle` (a context manager factory taking
    the system and the output folder) starts it before its sweep and stops it after; neither = already up.
    `probe`, if any, is read around each rate (see RateProbe)."""

    name: str
    base_url: str
    launch: str | None = None
    lifecycle: Callable[[SystemSpec, Path], AbstractContextManager[Any]] | None = None
    ready_timeout_s: float = 600.0
    extra: dict[str, Any] = field(default_factory=dict)  # free-form, copied into the JSON (e.g. schedule)
    probe: RateProbe | None = None


def wait_ready(base_url: str, timeout_s: float, process: subprocess.Popen | None = None,
               poll_s: float = 1.0) -> None:
    """Until GET /health or /v1/models answers 200; raises if the launched process exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"launch command exited with code {process.returncode} before {base_url} was ready")
        if answers(base_url, timeout_s=5.0):
            return
        time.sleep(poll_s)
    raise TimeoutError(f"{base_url} not ready (GET {' or '.join(READY_PATHS)}) after {timeout_s:.0f} s")


def answers(base_url: str, timeout_s: float = 2.0) -> bool:
    """Whether a server already answers GET /health or /v1/models with 200 at `base_url`."""
    for path in READY_PATHS:
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + path, timeout=timeout_s) as resp:
                if resp.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
    return False


# process groups this process started and the signal that stops each (SIGTERM; SIGINT for `serve run`, which then
# shuts its Ray cluster down): stop_on_sigterm's handler signals them before it unwinds the stack
_GROUPS: dict[int, int] = {}


def track_group(pgid: int, sig: int = signal.SIGTERM) -> None:
    """Stop process group `pgid` with `sig` if this process gets SIGTERM (stop_on_sigterm) before `untrack_group`."""
    _GROUPS[pgid] = sig


def untrack_group(pgid: int) -> None:
    _GROUPS.pop(pgid, None)


def stop_on_sigterm() -> None:
    """On SIGTERM (what `timeout` sends): signal every tracked process group at once, then raise SystemExit in the
    main thread, so the `finally` of `launched` waits for its server to stop. The groups get their signal first
    because the unwinding can hang (an asyncio run cancelling its tasks) until `timeout` kills this process; the
    handler runs once (`timeout` may signal the child and then its whole group)."""
    def _exit(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for pgid, sig in list(_GROUPS.items()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


@contextlib.contextmanager
def launched(system: SystemSpec, out_dir: Path) -> Iterator[None]:
    """Start `system.launch` in its own process group (log in out_dir), wait until ready, stop it after.
    Refuses to start when something already answers at its address: the sweep would measure that server."""
    if system.lifecycle is not None:
        with system.lifecycle(system, out_dir):
            wait_ready(system.base_url, system.ready_timeout_s)
            yield
        return
    if not system.launch:
        yield
        return
    refuse_if_answering(system.name, system.base_url)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / f"{system.name}-server.log"
    with open(log_path, "ab") as log:
        logger.info("starting %s: %s (log %s)", system.name, system.launch, log_path)
        proc = subprocess.Popen(system.launch, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        track_group(proc.pid)
        try:
            wait_ready(system.base_url, system.ready_timeout_s, proc)
            yield
        finally:
            _stop_group(proc)
            untrack_group(proc.pid)


def refuse_if_answering(name: str, base_url: str, settle_s: float = 10.0) -> None:
    """Raise if a server answers at `base_url` before `name` is started (the sweep would measure it), after up to
    `settle_s` for one just stopped to let its port go."""
    deadline = time.monotonic() + settle_s
    while answers(base_url, timeout_s=1.0):
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{base_url} already answers before {name} was started: another server holds its "
                               "port (one left by an earlier run?); stop it and run again")
        time.sleep(0.5)


def _stop_group(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM the process group we started, SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _actual_rate(requests: Sequence[RequestSpec]) -> float:
    span = requests[-1].arrival_s - requests[0].arrival_s if len(requests) > 1 else 0.0
    return (len(requests) - 1) / span if span > 0 else math.inf


def _probed_run(probe: RateProbe, config: BenchConfig,
                requests: list[RequestSpec]) -> tuple[BenchResult, dict[str, Any]]:
    """The run with `probe` read around its measured requests only: the warm-up requests go first in a run of
    their own (no measured requests), so whatever the probe counts leaves them out."""
    if config.warmup_requests > 0:
        asyncio.run(run_benchmark(replace(config, is_progress_shown=False), []))
    started = True
    try:
        probe.start()
    except Exception as e:  # a probe never fails the run
        logger.warning("probe %s failed before the run: %s", probe.name, e)
        started, found = False, {"error": f"start: {type(e).__name__}: {e}"}
    result = asyncio.run(run_benchmark(replace(config, warmup_requests=0), requests))
    if started:
        try:
            found = probe.finish()
        except Exception as e:
            logger.warning("probe %s failed after the run: %s", probe.name, e)
            found = {"error": f"finish: {type(e).__name__}: {e}"}
    result.config["warmup_requests"] = config.warmup_requests  # sent, just before, by the warm-up run above
    return result, found


def run_comparison(systems: Sequence[SystemSpec], base: BenchConfig, out_dir: str | Path,
                   rates: Sequence[float] = (), trace_scales: Sequence[float] = (),
                   cooldown_s: float = 0.0, plot: bool = True) -> dict[str, Any]:
    """Sweep every system over `rates` (Poisson) or `trace_scales` (Azure replay) with the same requests.

    Returns (and writes as compare.json) {config, slo, systems: {name: {points, goodput, error}}}; a system
    with a probe has `probes: {name: dict}` in each point and in each run file.
    """
    out = Path(out_dir)
    if bool(rates) == bool(trace_scales):
        raise ValueError("give rates (Poisson) or trace_scales (Azure replay), one of them")
    sweep = [("rate", r) for r in rates] + [("trace_scale", s) for s in trace_scales]
    workloads: dict[float, list[RequestSpec]] = {}
    for salt, (kind, value) in enumerate(sweep, start=1):  # distinct prompts per rate, same lengths and arrivals
        w = replace(base.workload, rate_rps=value if kind == "rate" else None,
                    trace_scale=value if kind == "trace_scale" else None, prompt_salt=salt)
        workloads[value] = build_workload(w)
    primary = parse_slo(base.slos[0])
    doc: dict[str, Any] = {"config": {**base.to_dict(), "rates": list(rates), "trace_scales": list(trace_scales)},
                           "slo": primary.to_dict(), "slos": [parse_slo(s).to_dict() for s in base.slos],
                           "systems": {}}
    for system in systems:
        entry: dict[str, Any] = {"base_url": system.base_url, "launch": system.launch, "extra": system.extra,
                                 "points": [], "error": None}
        doc["systems"][system.name] = entry
        try:
            with launched(system, out):
                for kind, value in sweep:
                    requests = workloads[value]
                    config = replace(base, base_url=system.base_url, label=system.name,
                                     workload=replace(base.workload, rate_rps=value if kind == "rate" else None,
                                                      trace_scale=value if kind == "trace_scale" else None))
                    path = out / "runs" / f"{system.name}-{kind}{value:g}.json"
                    point: dict[str, Any] = {}
                    if system.probe is None:
                        result = asyncio.run(run_benchmark(config, requests))
                        result.save(path)
                    else:
                        result, found = _probed_run(system.probe, config, requests)
                        point["probes"] = {system.probe.name: found}
                        write_json_atomic(path, {**result.to_dict(), **point})
                    rate = value if kind == "rate" else _actual_rate(requests)
                    entry["points"].append({"rate_rps": rate, kind: value, "summary": result.summary,
                                            "result_file": str(path.relative_to(out)), **point})
                    logger.info("%s %s=%g: attainment %.1f%% (%s)", system.name, kind, value,
                                100 * result.summary["slo"][primary.name]["attainment"], primary.name)
                    if cooldown_s:
                        time.sleep(cooldown_s)
        except Exception as e:  # one broken system must not lose the others' results
            logger.exception("system %s failed", system.name)
            entry["error"] = f"{type(e).__name__}: {e}"
        entry["goodput"] = {name: goodput([(p["rate_rps"], p["summary"]["slo"][name]["attainment"])
                                           for p in entry["points"]], name).to_dict()
                            for name in (parse_slo(s).name for s in base.slos)}
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "compare.json", doc)
    (out / "compare.md").write_text(comparison_markdown(doc) + "\n")
    if plot:
        report.plot_sweep({n: e["points"] for n, e in doc["systems"].items()}, primary.name, out / "compare.png",
                          {n: e["goodput"][primary.name] for n, e in doc["systems"].items()},
                          title=f"{base.workload.dataset}, seed {base.workload.seed}; SLO {primary.describe()}")
    return doc


def comparison_markdown(doc: dict[str, Any]) -> str:
    names = [s["name"] for s in doc["slos"]]
    header = ["system", "rate (req/s)", "done/sent", "out tok/s", "TTFT p50/p90 ms", "TPOT p50/p90 ms",
              "ITL p90 ms"] + [f"attain. {n}" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for system, entry in doc["systems"].items():
        for p in entry["points"]:
            s = p["summary"]
            row = [system, f"{p['rate_rps']:.2f}", f"{s['num_completed']}/{s['num_requests']}",
                   f"{s['output_throughput_tps']:.0f}",
                   f"{report._fmt(s['ttft_ms']['p50'])} / {report._fmt(s['ttft_ms']['p90'])}",
                   f"{report._fmt(s['tpot_ms']['p50'])} / {report._fmt(s['tpot_ms']['p90'])}",
                   report._fmt(s["itl_ms"]["p90"])] + [f"{s['slo'][n]['attainment']:.1%}" for n in names]
            lines.append("| " + " | ".join(row) + " |")
        if entry["error"]:
            lines.append(f"| {system} | failed: {entry['error']} |" + " |" * (len(header) - 2))
    lines += ["", "Goodput = highest swept rate with attainment >= 90% (measured) and where attainment crosses "
              "90% between swept rates (interpolated; '>=' = no swept rate missed).", "",
              "| system | SLO | goodput measured (req/s) | goodput interpolated (req/s) |", "|---|---|---|---|"]
    for system, entry in doc["systems"].items():
        for name, g in entry["goodput"].items():
            interp = "-" if g["interpolated_rps"] is None else \
                f"{'' if g['is_bracketed'] else '>= '}{g['interpolated_rps']:.2f}"
            lines.append(f"| {system} | {name} | {g['measured_rps']:.2f} | {interp} |")
    lines += ["", "SLOs: " + "; ".join(s["description"] for s in doc["slos"])]
    return "\n".join(lines)


def _pairs(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise SystemExit(f"{flag} {item!r}: expected NAME=VALUE")
        out[name] = value
    return out


def _floats(text: str | None) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()] if text else []


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.bench.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    c = parser.add_argument_group("comparison")
    c.add_argument("--endpoint", action="append", required=True, metavar="NAME=URL",
                   help="a system under test (repeatable), e.g. vllm=http://127.0.0.1:8001")
    c.add_argument("--launch", action="append", metavar='NAME="CMD"',
                   help="shell command that starts system NAME before its sweep (stopped after, by process group)")
    c.add_argument("--ready-timeout-s", type=float, default=600.0, help="wait this long for a launched server")
    c.add_argument("--rates", default=None, help="comma-separated request rates (req/s) to sweep, Poisson arrivals")
    c.add_argument("--trace-scales", default=None, help="instead of --rates: Azure trace replay speed-ups to sweep")
    c.add_argument("--cooldown-s", type=float, default=0.0, help="pause between runs")
    add_arguments(parser, is_sweep=True)
    parser.set_defaults(output_dir="benchmarks/results/compare")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    endpoints, launches = _pairs(args.endpoint, "--endpoint"), _pairs(args.launch, "--launch")
    unknown = set(launches) - set(endpoints)
    if unknown:
        raise SystemExit(f"--launch for {sorted(unknown)} without a matching --endpoint NAME=URL")
    systems = [SystemSpec(n, url, launches.get(n), ready_timeout_s=args.ready_timeout_s)
               for n, url in endpoints.items()]
    base = config_from_args(args)
    stop_on_sigterm()
    out = Path(args.output_dir) / datetime.now().strftime("%Y%m%d-%H%M%S")
    doc = run_comparison(systems, base, out, _floats(args.rates), _floats(args.trace_scales),
                         args.cooldown_s, args.plot)
    print(comparison_markdown(doc))
    print(f"results: {out}")
    return 0 if all(e["error"] is None for e in doc["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
