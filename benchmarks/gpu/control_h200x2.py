"""The control plane on two GPUs (nvidia-h200-x2): `serve run deploy/node.yaml` with two engines and a cluster
controller reading a real Prometheus, under load; the router's spread, the controller's pushes to both engines,
an operator lowering the max decode SMs mid-run, and every dashboard query. JSON to $OUT.

    bash benchmarks/gpu/run_serve_h100.sh stage      # once per carried folder (flashinfer, ray wheels)
    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.control_h200x2    # the run (~6 min)

The GPU machine cannot install packages: carry Debian's Prometheus binary (static apart from libc, 14 MB
gzipped) with the run call: `mkdir -p .carry/prometheus && gzip -c /usr/bin/prometheus >
.carry/prometheus/prometheus.gz`, carry=[".carry/prometheus"]; this script unpacks it when none is on PATH.

Phases (each `--phase-s` long, Poisson arrivals of random 512/128-token requests): `rising` (rate ramps from
`--rate` / 4 to `--rate`), `steady` at `--rate`, then the operator sets max_decode_sms = `--lowered-max-sms`
through the controller and `lowered` runs at `--rate`. After each phase the script records, from Prometheus:
requests per engine (router spread), decode SMs and bounds per engine, the controller's decisions, forecast vs
measured rate; and the bench client's TTFT/TPOT/attainment. At the end every panel query of
dashboards/bullet.json (variables = every value) is run and whether it returned data is recorded.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
logger = logging.getLogger("control_h200x2")
BASE_URL = "http://127.0.0.1:8000"
PROM_PORT = 9090
PROM_URL = f"http://127.0.0.1:{PROM_PORT}"


def promql(expr: str) -> list[dict[str, Any]]:
    import requests  # type: ignore[import-untyped]

    r = requests.get(f"{PROM_URL}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    if body.get("status") != "success":
        return [{"error": body.get("error")}]
    return [{"labels": s["metric"], "value": float(s["value"][1])} for s in body["data"]["result"]
            if s["value"][1] not in ("NaN", "+Inf", "-Inf")]


def write_yaml(out_dir: Path, num_engines: int, kv_gb: float, cpu_smoke: bool = False) -> Path:
    with open(REPO / "deploy" / "node.yaml") as f:
        cfg = yaml.safe_load(f)
    args = cfg["applications"][0]["args"]
    args["num_engines"] = num_engines
    args["engine"]["kv_cache_memory_gb"] = kv_gb
    if cpu_smoke:  # the same run on a CPU machine, to check the script itself
        cfg["http_options"]["host"] = "127.0.0.1"
        cfg["proxy_location"] = "HeadOnly"
        args.update({"num_ingress_replicas": 1, "engine_num_cpus": 0, "worker_num_cpus": 0})
        args["engine"] = {"model": "dummy:smollm2-135m", "device": "cpu", "num_kv_blocks": 256, "max_model_len": 1024}
    args["controller"] = {"app_name": cfg["applications"][0]["name"], "interval_s": 2.0, "horizon_s": 30.0,
                          "prometheus_url": PROM_URL, "min_engines": num_engines, "max_engines": num_engines}
    path = out_dir / "node_control.yaml"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def prometheus_binary() -> dict[str, str]:
    """{"PROMETHEUS_BIN": path} from the carried .carry/prometheus/prometheus.gz when none is on PATH."""
    import gzip
    import shutil

    carried = REPO / ".carry" / "prometheus" / "prometheus.gz"
    if shutil.which("prometheus") or not carried.exists():
        return {}
    target = Path("/tmp/bullet_bin/prometheus")
    target.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(carried) as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    target.chmod(0o755)
    return {"PROMETHEUS_BIN": str(target)}


def snapshot() -> dict[str, Any]:
    w = "[1m]"
    return {
        "requests_per_engine": promql(f"sum by (engine) (increase(ray_bullet_requests_arrived_total{w}))"),
        "decode_sms": promql("max by (engine, gpu) (ray_bullet_sm_split_decode_sms)"),
        "max_decode_sms_bound": promql("max by (engine, gpu) (ray_bullet_split_max_decode_sms)"),
        "decode_step_s": promql("max by (engine) (ray_bullet_decode_step_seconds)"),
        "predicted_decode_step_s": promql("max by (engine) (ray_bullet_predicted_decode_step_seconds)"),
        "controller_decisions": promql("sum by (mode) (ray_bullet_controller_decisions_total)"),
        "controller_rate_rps": promql("max by (kind) (ray_bullet_controller_arrival_rate_rps)"),
        "controller_replicas": promql("max(ray_bullet_controller_num_replicas)"),
        "attainment": promql('sum(rate(ray_bullet_request_slo_total{slo_met="true"}[1m])) / '
                             'sum(rate(ray_bullet_request_slo_total[1m]))'),
        "gpu_util": promql("max by (gpu) (ray_bullet_node_gpu_utilization_perc)"),
        "gpu_power_w": promql("max by (gpu) (ray_bullet_node_gpu_power_watts)"),
    }


def run_load(rate: float, duration_s: float, seed: int, input_tokens: int, output_tokens: int) -> dict[str, Any]:
    from benchmarks.serve_bench import BenchConfig, run_benchmark
    from benchmarks.traces import WorkloadConfig, build_workload

    workload = WorkloadConfig(dataset="random", num_prompts=None, duration_s=duration_s, rate_rps=rate,
                              random_input_tokens=input_tokens, random_output_tokens=output_tokens, seed=seed)
    config = BenchConfig(base_url=BASE_URL, workload=workload, slos=["relaxed", "strict"], is_progress_shown=False)
    s = asyncio.run(run_benchmark(config, build_workload(workload))).summary
    return {k: s.get(k) for k in ("num_completed", "num_failed", "request_throughput_rps", "ttft_ms", "tpot_ms",
                                  "slo")}


def dashboard_queries() -> list[dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("dashboards_generate", REPO / "dashboards" / "generate.py")
    gen = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["dashboards_generate"] = gen
    spec.loader.exec_module(gen)  # type: ignore[union-attr]
    out = []
    for panel in gen.panels():
        for t in panel.targets:
            expr = t.expr.replace("$__rate_interval", "1m")
            for var in gen.VARIABLES:
                expr = expr.replace(f"${var}", ".*")
            rows = promql(expr)
            out.append({"panel": panel.title, "legend": t.legend, "expr": expr, "num_series": len(rows),
                        "has_data": bool(rows) and "error" not in rows[0], "sample": rows[:4]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--num-engines", type=int, default=2)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=30.0)
    ap.add_argument("--rate", type=float, default=12.0, help="requests/s of the steady phases (both engines)")
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--lowered-max-sms", type=int, default=48)
    ap.add_argument("--ready-timeout-s", type=float, default=600.0)
    ap.add_argument("--input-tokens", type=int, default=512)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--cpu-smoke", action="store_true", help="dummy tiny model on CPU (checks this script)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.path.insert(0, str(REPO))
    from benchmarks.compare import wait_ready
    from benchmarks.gpu.serve_h100 import _stop, _wait_generates, gpu_memory_gib

    args.out.mkdir(parents=True, exist_ok=True)
    lengths = (args.input_tokens, args.output_tokens)
    yaml_path = write_yaml(args.out, args.num_engines, args.kv_cache_memory_gb, args.cpu_smoke)
    result: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(), "command": " ".join(sys.argv),
                              "device": subprocess.run("nvidia-smi -L", shell=True, capture_output=True,
                                                       text=True).stdout.strip(),
                              "yaml": yaml.safe_load(yaml_path.read_text()), "phases": {}}
    prom_env = {**os.environ, **prometheus_binary()}
    idle = gpu_memory_gib()
    log = open(args.out / "serve.log", "ab")  # noqa: SIM115 - serve run and Prometheus write to it until the end
    serve_proc = subprocess.Popen(["serve", "run", str(yaml_path)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    prom_proc = None
    try:
        started = time.monotonic()
        wait_ready(BASE_URL, args.ready_timeout_s, serve_proc)
        _wait_generates(BASE_URL, args.ready_timeout_s)
        result["ready_s"] = round(time.monotonic() - started, 1)
        prom_proc = subprocess.Popen(["bash", str(REPO / "deploy" / "prometheus.sh"), "--port", str(PROM_PORT),
                                      "--data-dir", "/tmp/bullet_prom_h200x2", "--scrape-interval", "2s"],
                                     stdout=log, stderr=subprocess.STDOUT, env=prom_env)
        time.sleep(10)
        import ray

        from bullet_ray.control.controller import NAMESPACE, controller_name

        ray.init(address="auto", log_to_driver=False)
        controller = ray.get_actor(controller_name(result["yaml"]["applications"][0]["name"]), namespace=NAMESPACE)
        for i, rate in enumerate((args.rate / 4, args.rate / 2, args.rate * 3 / 4)):
            result["phases"][f"rising_{i}"] = {"rate": rate, "client": run_load(rate, args.phase_s / 3, i, *lengths),
                                               "metrics": snapshot()}
        result["phases"]["steady"] = {"rate": args.rate, "client": run_load(args.rate, args.phase_s, 10, *lengths),
                                      "metrics": snapshot()}
        result["operator_update"] = ray.get(controller.update_config.remote({"max_decode_sms": args.lowered_max_sms}))
        time.sleep(10)
        result["phases"]["lowered"] = {"rate": args.rate, "client": run_load(args.rate, args.phase_s, 11, *lengths),
                                       "metrics": snapshot()}
        status = ray.get(controller.status.remote())
        result["controller"] = {k: status[k] for k in ("seq", "num_replicas", "overrides", "num_restores")}
        result["controller"]["last_pushes"] = [r["pushed"] for r in status["log"][-2:]]
        result["dashboard_queries"] = dashboard_queries()
        result["dashboard_queries_without_data"] = [q["panel"] + " / " + q["legend"]
                                                    for q in result["dashboard_queries"] if not q["has_data"]]
    finally:
        if prom_proc is not None:
            prom_proc.terminate()
        _stop(serve_proc, idle)
        log.close()
        with open(args.out / "control_h200x2.json", "w") as f:
            json.dump(result, f, indent=2, default=str)
    engines = {s["labels"].get("engine") for s in result["phases"].get("steady", {}).get("metrics", {})
               .get("requests_per_engine", [])}
    print(json.dumps({"engines_with_requests": len(engines),
                      "queries_without_data": result.get("dashboard_queries_without_data"),
                      "decode_sms_lowered": result["phases"].get("lowered", {}).get("metrics", {}).get("decode_sms")},
                     indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
