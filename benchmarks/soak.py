"""Soak: N minutes of steady Poisson load (the bench tool), sampling the engine every 30 s.

    python -m benchmarks.soak --config deploy/local.yaml --minutes 3 --rate 1 --out benchmarks/results/soak_cpu.json
    python -m benchmarks.soak --url http://127.0.0.1:8000 --minutes 30 --rate 8 --out benchmarks/results/soak_h100.json

Each sample: RSS and private (anonymous) RSS and open files of every engine process on this machine (the
replica front and its prefill/decode workers, found from /v1/internal/stats and the engines' pid files), KV
usage and running/waiting requests (/v1/internal/stats), the size of the engines' runtime folders and of
/dev/shm in all. Writes the JSON (samples, the bench summary, growth first -> last sample) and a PNG plot.
With --config it starts `serve run` itself and stops it with Ctrl-C at the end, checking the runtime folders
are released.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
from typing import Any

from benchmarks.faults import (
    ServeRun,
    dir_bytes,
    engine_processes,
    engine_stats,
    memory_bytes,
    open_files,
    provenance,
)
from bullet_ray.engine.runtime_dir import list_engines


def sample(url: str, t_s: float) -> dict[str, Any]:
    stats = engine_stats(url)
    pids, folders = engine_processes(url)
    processes = {name: {"pid": pid, **memory_bytes(pid), "open_files": open_files(pid)} for name, pid in pids.items()}
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    kv_total = stats.get("num_kv_blocks") or 0
    return {
        "t_s": round(t_s, 1),
        "processes": processes,
        "rss_total_bytes": sum(p.get("rss", 0) for p in processes.values()),
        "rss_anon_total_bytes": sum(p.get("rss_anon", 0) for p in processes.values()),
        "open_files_total": sum(p.get("open_files") or 0 for p in processes.values()),
        "kv_usage": 1 - stats["num_free_kv_blocks"] / kv_total if kv_total else None,
        "num_running": stats.get("num_running"), "num_waiting": stats.get("num_waiting"),
        "runtime_dirs": folders, "runtime_dir_bytes": sum(dir_bytes(f) for f in folders),
        "dev_shm_used_bytes": (shm.f_blocks - shm.f_bfree) * shm.f_frsize if shm else None,
        "num_engine_folders": len(list_engines()),
    }


def plot(samples: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    names = sorted({n for s in samples for n in s["processes"]})
    ax = axes[0][0]
    for name in names:
        ax.plot(minutes, [s["processes"].get(name, {}).get("rss", 0) / 2**20 for s in samples], label=f"{name} RSS")
        ax.plot(minutes, [s["processes"].get(name, {}).get("rss_anon", 0) / 2**20 for s in samples], "--",
                label=f"{name} private")
    ax.set_ylabel("MiB")
    ax.set_title("resident memory per engine process")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ax.plot(minutes, [100 * (s["kv_usage"] or 0) for s in samples], label="KV blocks used (%)")
    ax.plot(minutes, [s["num_running"] or 0 for s in samples], label="running requests")
    ax.plot(minutes, [s["num_waiting"] or 0 for s in samples], label="waiting requests")
    ax.set_title("engine load")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    ax.plot(minutes, [s["runtime_dir_bytes"] / 2**20 for s in samples], label="engine runtime folders")
    ax.plot(minutes, [(s["dev_shm_used_bytes"] or 0) / 2**20 for s in samples], label="/dev/shm in all")
    ax.set_ylabel("MiB")
    ax.set_xlabel("minutes")
    ax.set_title("shared memory")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    ax.plot(minutes, [s["open_files_total"] for s in samples])
    ax.set_xlabel("minutes")
    ax.set_title("open files (engine processes)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _run_load(url: str, rate: float, duration_s: float, input_tokens: int, output_tokens: int,
              out: dict[str, Any]) -> None:
    from benchmarks.serve_bench import BenchConfig, run_benchmark
    from benchmarks.traces import WorkloadConfig

    workload = WorkloadConfig(num_prompts=None, duration_s=duration_s, rate_rps=rate, random_input_tokens=input_tokens,
                              random_output_tokens=output_tokens, vocab_low=3, vocab_high=500)
    config = BenchConfig(base_url=url, workload=workload, slos=["relaxed"], is_progress_shown=False,
                         request_timeout_s=300.0, label="soak")
    result = asyncio.run(run_benchmark(config))
    out["summary"] = result.summary
    out["statuses"] = {}
    for record in result.records:
        key = str(record.http_status)
        out["statuses"][key] = out["statuses"].get(key, 0) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running deployment")
    where.add_argument("--config", help="a deploy YAML to `serve run` for the soak")
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--rate", type=float, default=1.0, help="mean requests/s (Poisson)")
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between samples")
    parser.add_argument("--out", default="benchmarks/results/soak.json", help="JSON; the PNG goes beside it")
    args = parser.parse_args(argv)
    from tqdm import tqdm

    run = ServeRun(args.config) if args.config else None
    if run is not None:
        run.start()
    url = run.url if run is not None else args.url.rstrip("/")
    result: dict[str, Any] = {**provenance(), "url": url, "config": args.config, "minutes": args.minutes,
                              "rate_rps": args.rate, "input_tokens": args.input_tokens,
                              "output_tokens": args.output_tokens, "samples": []}
    duration_s = args.minutes * 60
    try:
        load: dict[str, Any] = {}
        thread = threading.Thread(target=_run_load, args=(url, args.rate, duration_s, args.input_tokens,
                                                          args.output_tokens, load), daemon=True)
        start = time.monotonic()
        result["samples"].append(sample(url, 0.0))
        thread.start()
        with tqdm(total=int(duration_s), desc="soak", unit="s") as bar:
            next_sample = args.interval
            while thread.is_alive():
                thread.join(1.0)
                elapsed = time.monotonic() - start
                bar.n = min(int(elapsed), int(duration_s))
                bar.refresh()
                if elapsed >= next_sample:
                    result["samples"].append(sample(url, elapsed))
                    next_sample += args.interval
        result["samples"].append(sample(url, time.monotonic() - start))
        result.update(load)
    finally:
        if run is not None:
            run.stop()
    first, last = result["samples"][0], result["samples"][-1]
    result["growth"] = {key: last[key] - first[key] for key in
                        ("rss_total_bytes", "rss_anon_total_bytes", "open_files_total", "runtime_dir_bytes")}
    if run is not None:
        deadline = time.monotonic() + 60
        folders = sorted({f for s in result["samples"] for f in s["runtime_dirs"]})
        while time.monotonic() < deadline and any(os.path.exists(f) for f in folders):
            time.sleep(0.5)
        result["released_after_ctrl_c"] = not any(os.path.exists(f) for f in folders)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(result["samples"], png, f"soak: {args.minutes:g} min at {args.rate:g} req/s on {result['device']} "
                                 f"({result['date_utc'][:10]})")
    print(json.dumps({"growth": result["growth"], "statuses": result.get("statuses"),
                      "completed": result.get("summary", {}).get("num_completed")}, indent=1))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
