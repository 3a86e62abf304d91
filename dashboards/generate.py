"""Generates dashboards/bullet.json, the Grafana dashboard of a bullet_ray deployment, as code.

    python dashboards/generate.py            # writes dashboards/bullet.json
    python dashboards/generate.py --check    # exit 1 when bullet.json is not what this file generates

Plain Python dicts in Grafana's dashboard JSON model (schemaVersion 39), no SDK: the panels are a list of
`Panel`s, each with its PromQL targets, so tests can run every query against a real Prometheus
(tests/integration/test_control_prometheus.py). Titles follow vLLM's Grafana dashboard where the meaning
is the same (Time To First Token Latency, Inter Token Latency, E2E Request Latency, Scheduler State, Cache
Utilization, Token Throughput). Variables: datasource, model_name, app (controller), node (Prometheus
`instance`: a Ray node's export port), gpu (GPU UUID; "cpu" on CPU) and engine (Serve replica id).
Metric names: bullet_ray/metrics.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUT = os.path.join(HERE, "bullet.json")
UID = "bullet-ray-overview"
SEL = 'model_name=~"$model_name",instance=~"$node",gpu=~"$gpu",engine=~"$engine"'
CTL = 'app=~"$app"'
NODE = 'instance=~"$node",gpu=~"$gpu"'
RI = "$__rate_interval"
# what the query tests substitute for each variable (every value)
VARIABLES = ("model_name", "app", "node", "gpu", "engine")


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    gpu_only: bool = False  # NVML readings: no data on a CPU-only deployment
    after_switch: bool = False  # data only once the split has moved (a steady engine may not switch)
    extra: dict = field(default_factory=dict)


def quantiles(metric: str, qs: tuple[float, ...] = (0.5, 0.9, 0.99), by: str = "", over: str = "rate",
              window: str = RI) -> tuple[Target, ...]:
    """Quantiles of a histogram's `over` (rate, increase) across the selected engines, one series per `by`."""
    keys, legend = ("le, " + by, f" {{{{{by}}}}}") if by else ("le", "")
    return tuple(Target(f"histogram_quantile({q}, sum by ({keys}) ({over}(ray_bullet_{metric}_bucket{{{SEL}}}"
                        f"[{window}])))", f"p{int(q * 100)}{legend}") for q in qs)


def labelled(prefix: str, targets: tuple[Target, ...]) -> tuple[Target, ...]:
    """`targets` with `prefix` before each legend (two histograms' quantiles in one panel)."""
    return tuple(Target(t.expr, f"{prefix} {t.legend}") for t in targets)


def rate(metric: str, extra: str = "", by: str = "") -> str:
    sel = SEL + ("," + extra if extra else "")
    return f"sum{f' by ({by})' if by else ''}(rate(ray_bullet_{metric}{{{sel}}}[{RI}]))"


ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    ("Latency and SLO", (
        Panel("Time To First Token Latency", "TTFT percentiles over all selected engines; the dashed line is the "
              "TTFT target in force (pushed by the controller, else the engine's).",
              (*quantiles("time_to_first_token_seconds"),
               Target(f"max(ray_bullet_slo_ttft_target_seconds{{{SEL}}})", "target")), "s"),
        Panel("Inter Token Latency", "Time between two output tokens (TPOT) percentiles; the dashed line is the "
              "TPOT target.", (*quantiles("inter_token_latency_seconds"),
                               Target(f"max(ray_bullet_slo_tpot_target_seconds{{{SEL}}})", "target")), "s"),
        Panel("E2E Request Latency", "Arrival to last token.", quantiles("e2e_request_latency_seconds"), "s"),
        Panel("SLO Attainment", "Share of finished requests that met both the TTFT and the TPOT target "
              "(DistServe's attainment).",
              (Target(f'{rate("request_slo_total", "slo_met=" + chr(34) + "true" + chr(34))} / '
                      f'{rate("request_slo_total")}', "attainment"),), "percentunit"),
        Panel("Goodput", "Requests per second finished within both targets, next to all finished requests.",
              (Target(rate("request_slo_total", 'slo_met="true"'), "goodput"),
               Target(rate("request_success_total"), "finished")), "reqps"),
        Panel("Token Throughput", "Prompt tokens prefilled and tokens generated per second.",
              (Target(rate("prompt_tokens_total"), "prompt"), Target(rate("generation_tokens_total"), "generation")),
              "short"),
    )),
    ("Load", (
        Panel("Scheduler State", "Requests decoding (running) and without a first token yet (waiting), per engine.",
              (Target(f"sum by (engine) (ray_bullet_num_requests_running{{{SEL}}})", "running {{engine}}"),
               Target(f"sum by (engine) (ray_bullet_num_requests_waiting{{{SEL}}})", "waiting {{engine}}"))),
        Panel("Cache Utilization", "Share of each engine's KV blocks in use.",
              (Target(f"max by (engine) (ray_bullet_kv_cache_usage_perc{{{SEL}}})", "{{engine}}"),), "percentunit"),
        Panel("Admissions Rejected", "Requests answered 429 by admission per second, and the queue limit in force "
              "(the controller shortens it when demand exceeds the GPU budget).",
              (Target(rate("admissions_rejected_total", by="engine"), "429/s {{engine}}"),
               Target(f"max by (engine) (ray_bullet_admission_max_waiting{{{SEL}}})", "queue limit {{engine}}"))),
        Panel("Garbage Collection", "Share of each engine process's time spent in Python garbage collections (front: "
              "the Serve replica running the engine front; prefill, decode, hybrid: its workers). Every process "
              "freezes its start-up heap (engine.gc_freeze), so this stays near 0; a collection stops its process's "
              "host thread, and in a worker the step it is launching.",
              (Target(rate("gc_pause_seconds_total", by="process"), "{{process}}"),), "percentunit"),
        Panel("Arrival Rate: Forecast vs Actual", "Requests arriving per second as the engines count them, and the "
              "controller's measurement and forecast (horizon_s ahead).",
              (Target(rate("requests_arrived_total"), "actual"),
               Target(f"max by (kind) (ray_bullet_controller_arrival_rate_rps{{{CTL}}})", "controller {{kind}}")),
              "reqps"),
    )),
    ("SM split", (
        Panel("SM Split per GPU", "SMs the decode and prefill sides run on now, and the decode bounds pushed by "
              "the controller. On CPU the 'none' partitioner keeps the same ladder bookkeeping.",
              (Target(f"max by (gpu, engine) (ray_bullet_sm_split_decode_sms{{{SEL}}})", "decode {{gpu}}"),
               Target(f"max by (gpu, engine) (ray_bullet_sm_split_prefill_sms{{{SEL}}})", "prefill {{gpu}}"),
               Target(f"max by (gpu, engine) (ray_bullet_split_min_decode_sms{{{SEL}}})", "decode min {{gpu}}"),
               Target(f"max by (gpu, engine) (ray_bullet_split_max_decode_sms{{{SEL}}})", "decode max {{gpu}}"))),
        Panel("Decode Step Time: Predicted vs Measured", "The last decode step's wall time and the split policy's "
              "prediction on the current split (split_policy: slo).",
              (Target(f"max by (engine) (ray_bullet_decode_step_seconds{{{SEL}}})", "measured {{engine}}"),
               Target(f"max by (engine) (ray_bullet_predicted_decode_step_seconds{{{SEL}}})",
                      "predicted {{engine}}")), "s"),
        Panel("Predicted TTFT", "Predicted time to first token of a request arriving now (router and admission use "
              "it).", (Target(f"max by (engine) (ray_bullet_predicted_ttft_seconds{{{SEL}}})", "{{engine}}"),), "s"),
        Panel("Step Prediction Error", "|predicted - measured| / measured step time of each side, median and p90 "
              "over the window: how well the performance model knows the GPU (issue 12's goal: 10% / 25%).",
              quantiles("step_prediction_error", (0.5, 0.9), by="phase"), "percentunit"),
        Panel("Split Switch Time", "From a split decision to both sides launching on the new split (acked) and to "
              "no step of either side left on the old one (drained: a step launched before still runs where it was "
              "launched), p50 and p99 over the switches of the last 5 minutes (a steady load may not switch for "
              "minutes).",
              (*labelled("acked", quantiles("split_switch_seconds", (0.5, 0.99), over="increase", window="5m")),
               *labelled("drained", quantiles("split_switch_drain_seconds", (0.5, 0.99), over="increase",
                                              window="5m"))), "s", after_switch=True),
        Panel("Prefill to Decode Hand-off", "From the prefill worker sending a prefilled sequence to the decode "
              "worker taking it (relayed by the engine front, or direct: engine.handoff), p50 and p99; it includes "
              "waiting for the decode side's step in flight.",
              quantiles("handoff_seconds", (0.5, 0.99)), "s"),
        Panel("Split Decisions by Reason", "Split decisions per minute by the rule's reason (split_policy: slo): "
              "balance / balance_tpot (TTFT at risk with decode over its TPOT target), backlog (queued requests miss "
              "their TTFT whatever the split), to_prefill / to_decode, only_prefill / only_decode, hold, idle, mixed.",
              (Target(f"sum by (reason) (increase(ray_bullet_split_decisions_total{{{SEL}}}[1m]))", "{{reason}}"),)),
        Panel("CUDA Graphs Captured While Serving", "Graphs each engine's workers captured after start: every one "
              "is captured at start, so anything above 0 is a step shape the start-up missed (and a stall).",
              (Target(f"max by (engine) (ray_bullet_graph_captures_serving{{{SEL}}})", "{{engine}}"),)),
    )),
    ("Controller", (
        Panel("Controller Decisions", "Decisions per minute by admission mode (queue: budget covers demand; shed: "
              "it does not).",
              (Target(f"sum by (mode) (increase(ray_bullet_controller_decisions_total{{{CTL}}}[1m]))", "{{mode}}"),)),
        Panel("Engine Replicas", "Replicas the controller asks for and engines reporting metrics.",
              (Target(f"max(ray_bullet_controller_num_replicas{{{CTL}}})", "decided"),
               Target(f"count(max by (engine) (ray_bullet_num_requests_running{{{SEL}}}))", "reporting"))),
        Panel("Demand vs Capacity", "Prompt + output tokens per second, measured and forecast, against the capacity "
              "of the decided replicas.",
              (Target(f"max by (kind) (ray_bullet_controller_demand_tokens_per_s{{{CTL}}})", "demand {{kind}}"),
               Target(f"max(ray_bullet_controller_capacity_tokens_per_s{{{CTL}}})", "capacity"))),
        Panel("Length Mix", "Mean prompt and output tokens, measured and forecast.",
              (Target(f"max by (phase, kind) (ray_bullet_controller_mean_tokens{{{CTL}}})", "{{phase}} {{kind}}"),)),
    )),
    ("Nodes", (
        Panel("GPU Utilization", "NVML: share of time a kernel ran, per GPU.",
              (Target(f"max by (gpu) (ray_bullet_node_gpu_utilization_perc{{{NODE}}})", "{{gpu}}"),),
              "percentunit", gpu_only=True),
        Panel("GPU Memory Used", "NVML, per GPU.",
              (Target(f"max by (gpu) (ray_bullet_node_gpu_memory_used_bytes{{{NODE}}})", "{{gpu}}"),), "bytes",
              gpu_only=True),
        Panel("GPU Power", "NVML, per GPU.",
              (Target(f"max by (gpu) (ray_bullet_node_gpu_power_watts{{{NODE}}})", "{{gpu}}"),), "watt",
              gpu_only=True),
        Panel("MPS Daemon", "1 where the node agent finds the node's MPS daemon answering.",
              (Target('max by (node) (ray_bullet_node_mps_running{instance=~"$node"})', "{{node}}"),)),
    )),
)


def panels() -> list[Panel]:
    return [p for _, row in ROWS for p in row]


def _variable(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "query": {"query": query, "refId": f"var-{name}"}, "definition": query, "refresh": 2, "includeAll": True,
            "multi": True, "allValue": ".*", "current": {"text": "All", "value": "$__all"}, "sort": 1}


def _panel_json(p: Panel, panel_id: int, x: int, y: int) -> dict:
    overrides = [{"matcher": {"id": "byRegexp", "options": ".*(target|min|max|limit).*"},
                  "properties": [{"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]}]
    return {"id": panel_id, "type": "timeseries", "title": p.title, "description": p.description,
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": p.unit, "custom": {"lineWidth": 1, "fillOpacity": 0}},
                            "overrides": overrides},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
            "targets": [{"refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend, "range": True,
                         "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                        for i, t in enumerate(p.targets)]}


def build() -> dict:
    out: list[dict] = []
    y, panel_id = 0, 1
    for title, row in ROWS:
        out.append({"id": panel_id, "type": "row", "title": title, "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        panel_id, y = panel_id + 1, y + 1
        for i, p in enumerate(row):
            out.append(_panel_json(p, panel_id, 8 * (i % 3), y + 8 * (i // 3)))
            panel_id += 1
        y += 8 * ((len(row) + 2) // 3)
    variables = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0},
        _variable("model_name", "Model", "label_values(ray_bullet_num_requests_running, model_name)"),
        _variable("app", "Application", "label_values(ray_bullet_controller_num_replicas, app)"),
        _variable("node", "Node", "label_values(ray_bullet_num_requests_running, instance)"),
        _variable("gpu", "GPU", "label_values(ray_bullet_num_requests_running, gpu)"),
        _variable("engine", "Replica", 'label_values(ray_bullet_num_requests_running{gpu=~"$gpu"}, engine)'),
    ]
    return {"uid": UID, "title": "bullet_ray", "description": "bullet_ray serving: latency against SLOs, load, "
            "SM split, the cluster controller and node telemetry. Generated by dashboards/generate.py.",
            "tags": ["bullet_ray", "llm", "ray-serve"], "timezone": "browser", "schemaVersion": 39, "version": 1,
            "editable": True, "graphTooltip": 1, "refresh": "10s", "time": {"from": "now-30m", "to": "now"},
            "templating": {"list": variables}, "annotations": {"list": []}, "panels": out}


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail when bullet.json is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(OUTPUT) as f:
            if f.read() != text:
                print(f"{OUTPUT} is out of date: run python dashboards/generate.py", file=sys.stderr)
                return 1
        return 0
    with open(OUTPUT, "w") as f:
        f.write(text)
    print(f"wrote {OUTPUT} ({len(panels())} panels)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
