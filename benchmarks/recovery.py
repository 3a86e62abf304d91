"""Recovery time after a fault: `serve run <deploy config>`, then under load kill the decode worker, the prefill
worker and the engine replica process in turn (SIGKILL), and measure kill -> first successful request.

    python -m benchmarks.recovery deploy/local.yaml --out benchmarks/results/recovery_cpu.json
    python -m benchmarks.recovery deploy/gpu.yaml --out benchmarks/results/recovery_h100.json   # on the GPU

For each fault it records what the in-flight streams got (completed / error event / finish_reason error / cut /
hung), what probe requests sent one after another (0.2 s apart) got until the first success (200, 503 +
Retry-After, '200-error': a non-streamed request that was running when the engine died), the time to the
first success (recovery_s), to a new engine front answering the stats route (replica_replaced_s), and until
the dead engine's runtime folder and processes were gone (dead_engine_released_s). At the end `serve run` is stopped with Ctrl-C and the runtime folders checked again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from collections import Counter
from typing import Any

from benchmarks.faults import ServeRun, engine_stats, model_name, probe, provenance, start_stream
from bullet_ray.engine.runtime_dir import ProcessRef

TARGETS = ("decode", "prefill", "replica")


def _victim_pid(stats: dict[str, Any], target: str) -> int:
    return int(stats["pid"] if target == "replica" else stats["worker_pids"][target])


def _wait_steady(url: str, model: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stats = engine_stats(url)
            if {"prefill", "decode"} <= set(stats.get("worker_pids") or {}) and probe(url, model)[0] == 200:
                return stats
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(1)
    raise RuntimeError(f"the deployment did not become healthy in {timeout_s:.0f} s")


def measure_fault(url: str, model: str, target: str, num_streams: int, max_tokens: int,
                  timeout_s: float) -> dict[str, Any]:
    stats = _wait_steady(url, model, timeout_s)
    folder = stats["runtime_dir"]
    processes = [ProcessRef.of(int(stats["pid"]))] + [ProcessRef.of(int(p)) for p in stats["worker_pids"].values()]
    streams = [start_stream(url, model, [5, 6, 7, 8 + i], max_tokens) for i in range(num_streams)]
    for s in streams:
        s.first_chunk.wait(120)
    in_flight_at_kill = sum(not s.done.is_set() for s in streams)
    killed_at = time.monotonic()
    os.kill(_victim_pid(stats, target), signal.SIGKILL)

    timeline: list[dict[str, Any]] = []
    marks: dict[str, float] = {}
    done = threading.Event()

    def watch() -> None:  # the replacement and the release, polled apart from the (possibly waiting) probes
        while not done.is_set() and time.monotonic() - killed_at < timeout_s:
            now = time.monotonic() - killed_at
            if "released_s" not in marks and not os.path.exists(folder) and not any(p.is_running() for p in processes):
                marks["released_s"] = now
            if "replaced_s" not in marks:
                try:
                    if int(engine_stats(url, timeout_s=2)["pid"]) != int(stats["pid"]):
                        marks["replaced_s"] = time.monotonic() - killed_at
                except Exception:  # noqa: BLE001 - no replica answers right now
                    pass
            if len(marks) == 2:
                return
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    first_success_s = None
    while time.monotonic() - killed_at < timeout_s:
        sent = time.monotonic() - killed_at
        status, retry_after = probe(url, model)
        now = time.monotonic() - killed_at
        timeline.append({"sent_s": round(sent, 3), "answered_s": round(now, 3), "status": status,
                         "retry_after": retry_after})
        if status == 200:
            first_success_s = now
            break
        time.sleep(0.2)
    watcher.join(timeout_s)
    done.set()
    for s in streams:
        s.done.wait(120)
    statuses = Counter(str(p["status"]) for p in timeline)
    refusals = [p for p in timeline if p["status"] in (429, 503)]
    return {
        "target": target, "killed_pid": _victim_pid(stats, target), "num_streams": num_streams,
        "num_in_flight_at_kill": in_flight_at_kill,
        "in_flight_outcomes": dict(Counter(s.kind() for s in streams)),
        "recovery_s": first_success_s, "replica_replaced_s": marks.get("replaced_s"),
        "dead_engine_released_s": marks.get("released_s"),
        "probe_statuses": dict(statuses),
        "refusals_with_retry_after": sum(p["retry_after"] is not None for p in refusals),
        "num_refusals": len(refusals), "probe_timeline": timeline,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="a deploy YAML (e.g. deploy/local.yaml, deploy/gpu.yaml)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated: decode, prefill, replica")
    parser.add_argument("--streams", type=int, default=4, help="in-flight streaming requests at each kill")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens of each in-flight stream")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for recovery per fault")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override an app arg, e.g. --set engine.model=dummy:tiny-llama (YAML value)")
    parser.add_argument("--out", default="benchmarks/results/recovery.json")
    args = parser.parse_args(argv)
    import yaml

    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    run = ServeRun(args.config, overrides=overrides)
    result: dict[str, Any] = {**provenance(), "config": args.config, "overrides": overrides, "faults": []}
    started = time.monotonic()
    run.start()
    result["startup_s"] = time.monotonic() - started
    try:
        model = model_name(run.url)
        for target in args.targets.split(","):
            fault = measure_fault(run.url, model, target.strip(), args.streams, args.max_tokens, args.timeout)
            print(f"{target}: recovery {fault['recovery_s']} s, replaced {fault['replica_replaced_s']} s, "
                  f"released {fault['dead_engine_released_s']} s, in flight {fault['in_flight_outcomes']}, "
                  f"probes {fault['probe_statuses']}", flush=True)
            result["faults"].append(fault)
        stats = engine_stats(run.url)
        folder = stats["runtime_dir"]
        processes = [ProcessRef.of(int(stats["pid"]))] + [ProcessRef.of(int(p)) for p in stats["worker_pids"].values()]
    finally:
        stopped = time.monotonic()
        run.stop()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (os.path.exists(folder) or any(p.is_running() for p in processes)):
        time.sleep(0.2)
    result["ctrl_c"] = {"released": not os.path.exists(folder) and not any(p.is_running() for p in processes),
                        "released_s": time.monotonic() - stopped}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
