"""Prometheus metrics through Ray's metrics export, named as vLLM names them under a `bullet` prefix.

vLLM writes `vllm:time_to_first_token_seconds`. Ray 2.60 refuses ':' in metric names, so ours are
registered as `bullet_<vllm name>`; Ray's exporter on each node (the node's metrics export port, listed
in /tmp/ray/prom_metrics_service_discovery.json, which deploy/prometheus.yml reads) prefixes `ray_` and
gives counters a `_total` suffix. What Prometheus sees (checked by
tests/integration/test_serve_openai.py::test_metrics_reach_the_node_exporter):

    ray_bullet_time_to_first_token_seconds_{bucket,sum,count}   vllm:time_to_first_token_seconds
    ray_bullet_inter_token_latency_seconds_{bucket,sum,count}   vllm:inter_token_latency_seconds
    ray_bullet_e2e_request_latency_seconds_{bucket,sum,count}   vllm:e2e_request_latency_seconds
    ray_bullet_num_requests_running / _waiting                  vllm:num_requests_running / _waiting
    ray_bullet_kv_cache_usage_perc  (0..1)                      vllm:kv_cache_usage_perc
    ray_bullet_prompt_tokens_total / generation_tokens_total    vllm:prompt_tokens_total / ...
    ray_bullet_request_success_total{finished_reason=...}       vllm:request_success_total
    ray_bullet_admissions_rejected_total                        (bullet's own: 429s by admission)
    ray_bullet_sm_split_decode_sms / _prefill_sms               (bullet's own: SMs each side runs on now)
    ray_bullet_decode_step_seconds                              (bullet's own: the last decode step's time)
    ray_bullet_predicted_ttft_seconds                           (bullet's own: of a request arriving now)
    ray_bullet_predicted_decode_step_seconds                    (bullet's own: the performance model's prediction)
    ray_bullet_requests_arrived_total                           (bullet's own: admitted or refused)
    ray_bullet_request_slo_total{slo_met="true|false"}          (bullet's own: both targets met; rate = goodput)
    ray_bullet_slo_ttft_target_seconds / _tpot_target_seconds   (bullet's own: the targets in force; TTFT's is the
                                                                floor under a per-prompt-token target, which is
                                                                the engine's ttft_target_ms_per_prompt_token)
    ray_bullet_split_min_decode_sms / _max_decode_sms           (bullet's own: the controller's bounds in force)
    ray_bullet_admission_max_waiting                            (bullet's own: the queue limit in force)
    ray_bullet_step_seconds_{bucket,sum,count}{phase}           (bullet's own: measured step time per side)
    ray_bullet_step_predicted_seconds_{bucket,sum,count}{phase} (bullet's own: the model's prediction of it)
    ray_bullet_step_prediction_error_{bucket,sum,count}{phase}  (bullet's own: |predicted - measured| / measured)
    ray_bullet_split_switch_seconds_{bucket,sum,count}          (bullet's own: split decision -> both sides
                                                                launching on it, their acks)
    ray_bullet_split_switch_drain_seconds_{bucket,sum,count}    (bullet's own: split decision -> no step of
                                                                either side left on the old split)
    ray_bullet_handoff_seconds_{bucket,sum,count}               (bullet's own: a prefilled sequence from the
                                                                prefill worker's send to the decode worker taking
                                                                it, relayed by the front or direct: engine.handoff)
    ray_bullet_split_decision_seconds                           (bullet's own: what the last decision cost)
    ray_bullet_split_decisions_total{reason=...}                (bullet's own: split decisions by SplitReason)
    ray_bullet_graph_captures_serving                           (bullet's own: CUDA graphs captured after start;
                                                                every one is captured at start, so 0)
    ray_bullet_gc_pause_seconds_total{process=...}              (bullet's own: time each process of the engine spent
    ray_bullet_gc_collections_total{process=...}                in Python garbage collections, and how many; process
                                                                front (the Serve replica), prefill, decode or hybrid)

The step series come from the workers' per-step records in the state block (LLMEngine.drain_step_records:
at most its ring's last 63 steps per side between two metric updates, so they sample a busy engine).

The cluster controller (tags app) and node agents (tags node, gpu) export:

    ray_bullet_controller_decisions_total{mode="queue|shed"}    ray_bullet_controller_num_replicas
    ray_bullet_controller_arrival_rate_rps{kind="measured|forecast"}
    ray_bullet_controller_demand_tokens_per_s{kind=...}         ray_bullet_controller_capacity_tokens_per_s
    ray_bullet_controller_mean_tokens{phase="prompt|output", kind=...}
    ray_bullet_controller_slo_attainment                        ray_bullet_controller_push_failures_total
    ray_bullet_controller_decode_sms_bound{engine, bound="min|max"}
    ray_bullet_node_gpu_utilization_perc / _memory_used_bytes / _power_watts, ray_bullet_node_mps_running

Engine series carry the tags model_name, engine (the Serve replica id) and gpu (its UUID; "cpu"), plus Ray's own labels
(NodeAddress, WorkerId, SessionName...). Buckets are vLLM's.
"""

from __future__ import annotations

from typing import Any

from bullet_ray.policy.slo import SloTargets

# vLLM's buckets where the meaning is the same
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]
E2E_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0]
STEP_BUCKETS_S = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5,
                  1.0, 2.5]
REL_ERROR_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.0]
SWITCH_BUCKETS_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                    1.0]
TAGS = ("model_name", "engine", "gpu")


class EngineMetrics:
    """Per-engine-replica metrics; a no-op outside a Ray worker."""

    def __init__(self, model_name: str, engine_id: str, gpu: str = "cpu", ttft_target_s: float = 0.5,
                 tpot_target_s: float = 0.025, ttft_per_token_s: float | None = None) -> None:
        """`ttft_per_token_s`: Bullet's per-prompt-token TTFT target (None: off); a request then meets TTFT
        within max(ttft_target_s, it x its prompt tokens)."""
        from ray.util import metrics as m

        tags = {"model_name": model_name, "engine": engine_id, "gpu": gpu}
        self.ttft = m.Histogram("bullet_time_to_first_token_seconds", "Time to first token (s).",
                                boundaries=TTFT_BUCKETS_S, tag_keys=TAGS)
        self.itl = m.Histogram("bullet_inter_token_latency_seconds", "Time between two output tokens (s).",
                               boundaries=ITL_BUCKETS_S, tag_keys=TAGS)
        self.e2e = m.Histogram("bullet_e2e_request_latency_seconds", "Request latency, arrival to finish (s).",
                               boundaries=E2E_BUCKETS_S, tag_keys=TAGS)
        self.running = m.Gauge("bullet_num_requests_running", "Requests decoding.", tag_keys=TAGS)
        self.waiting = m.Gauge("bullet_num_requests_waiting", "Requests without a first token yet.", tag_keys=TAGS)
        self.kv_usage = m.Gauge("bullet_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", tag_keys=TAGS)
        self.prompt_tokens = m.Counter("bullet_prompt_tokens", "Prompt tokens processed.", tag_keys=TAGS)
        self.generation_tokens = m.Counter("bullet_generation_tokens", "Tokens generated.", tag_keys=TAGS)
        self.success = m.Counter("bullet_request_success", "Finished requests by finish reason.",
                                 tag_keys=(*TAGS, "finished_reason"))
        self.rejected_total = m.Counter("bullet_admissions_rejected", "Requests answered 429 by admission.",
                                        tag_keys=TAGS)
        self.decode_sms = m.Gauge("bullet_sm_split_decode_sms", "SMs the decode side runs on now.", tag_keys=TAGS)
        self.prefill_sms = m.Gauge("bullet_sm_split_prefill_sms", "SMs the prefill side runs on now.",
                                   tag_keys=TAGS)
        self.decode_step = m.Gauge("bullet_decode_step_seconds", "Wall time of the last decode step (s).",
                                   tag_keys=TAGS)
        self.predicted_ttft = m.Gauge("bullet_predicted_ttft_seconds",
                                      "Predicted time to first token of a request arriving now (s).", tag_keys=TAGS)
        self.predicted_decode_step = m.Gauge("bullet_predicted_decode_step_seconds",
                                             "Decode step time the split policy predicts on the current split (s).",
                                             tag_keys=TAGS)
        self.arrived_total = m.Counter("bullet_requests_arrived", "Requests that reached the engine (admitted or "
                                       "refused).", tag_keys=TAGS)
        self.slo_total = m.Counter("bullet_request_slo", "Finished requests by whether both the TTFT and the TPOT "
                                   "target were met.", tag_keys=(*TAGS, "slo_met"))
        self.ttft_target = m.Gauge("bullet_slo_ttft_target_seconds", "TTFT target in force (s); with a per-prompt-"
                                   "token target, its floor: a request's is max(this, per-token x prompt tokens).",
                                   tag_keys=TAGS)
        self.tpot_target = m.Gauge("bullet_slo_tpot_target_seconds", "TPOT target in force (s).", tag_keys=TAGS)
        self.min_decode_sms = m.Gauge("bullet_split_min_decode_sms", "Fewest decode SMs allowed now.", tag_keys=TAGS)
        self.max_decode_sms = m.Gauge("bullet_split_max_decode_sms", "Most decode SMs allowed now.", tag_keys=TAGS)
        self.max_waiting = m.Gauge("bullet_admission_max_waiting", "Admission queue limit in force.", tag_keys=TAGS)
        step_tags = (*TAGS, "phase")
        self.step = m.Histogram("bullet_step_seconds", "Measured step time of a side (s).",
                                boundaries=STEP_BUCKETS_S, tag_keys=step_tags)
        self.step_predicted = m.Histogram("bullet_step_predicted_seconds", "Predicted step time of a side (s).",
                                          boundaries=STEP_BUCKETS_S, tag_keys=step_tags)
        self.step_error = m.Histogram("bullet_step_prediction_error", "|predicted - measured| / measured step time.",
                                      boundaries=REL_ERROR_BUCKETS, tag_keys=step_tags)
        self.switch = m.Histogram("bullet_split_switch_seconds", "Split decision to both sides launching on the new "
                                  "split (s).", boundaries=SWITCH_BUCKETS_S, tag_keys=TAGS)
        self.switch_drain = m.Histogram("bullet_split_switch_drain_seconds", "Split decision to no step of either "
                                        "side left on the old split (s).", boundaries=SWITCH_BUCKETS_S, tag_keys=TAGS)
        self.handoff = m.Histogram("bullet_handoff_seconds", "A prefilled sequence from the prefill worker's send "
                                   "to the decode worker taking it (s).", boundaries=SWITCH_BUCKETS_S, tag_keys=TAGS)
        self.decision_cost = m.Gauge("bullet_split_decision_seconds", "Time the last split decision took (s).",
                                     tag_keys=TAGS)
        self.decisions = m.Counter("bullet_split_decisions", "Split decisions by reason (bullet_ray.policy.state."
                                   "SplitReason: balance, balance_tpot, backlog, to_prefill, ...).",
                                   tag_keys=(*TAGS, "reason"))
        self._decisions_seen: dict[str, int] = {}  # the engine's cumulative counts already added
        self.captures_serving = m.Gauge("bullet_graph_captures_serving", "CUDA graphs the engine's workers captured "
                                        "after start (0: every graph was captured at start).", tag_keys=TAGS)
        gc_tags = (*TAGS, "process")
        self.gc_seconds = m.Counter("bullet_gc_pause_seconds", "Time each engine process (front: the Serve replica; "
                                    "prefill, decode, hybrid: its workers) spent in Python garbage collections (s).",
                                    tag_keys=gc_tags)
        self.gc_collections = m.Counter("bullet_gc_collections", "Python garbage collections per engine process.",
                                        tag_keys=gc_tags)
        self._gc_seen: dict[str, tuple[float, int]] = {}  # each process's cumulative totals already added
        for metric in (self.gc_seconds, self.gc_collections, self.ttft, self.itl, self.e2e, self.running,
                       self.waiting, self.kv_usage,
                       self.prompt_tokens, self.generation_tokens, self.rejected_total, self.decode_sms,
                       self.prefill_sms, self.decode_step, self.predicted_ttft, self.predicted_decode_step,
                       self.arrived_total, self.ttft_target, self.tpot_target, self.min_decode_sms,
                       self.max_decode_sms, self.max_waiting, self.switch, self.switch_drain, self.handoff,
                       self.decision_cost, self.decisions, self.captures_serving, self.success, self.slo_total, self.step,
                       self.step_predicted, self.step_error):
            metric.set_default_tags(tags)
        self.targets = SloTargets(ttft_target_s, tpot_target_s, ttft_per_token_s)
        self.set_targets(ttft_target_s, tpot_target_s)

    @property
    def ttft_target_s(self) -> float:
        """The TTFT target in force; the floor under a per-prompt-token one."""
        return self.targets.ttft_s

    @property
    def tpot_target_s(self) -> float:
        return self.targets.tpot_s

    def set_targets(self, ttft_target_s: float, tpot_target_s: float) -> None:
        """The SLO targets that attainment is measured against from now on (a controller's push); the
        per-prompt-token TTFT target, if any, stays."""
        self.targets = SloTargets(ttft_target_s, tpot_target_s, self.targets.ttft_per_token_s)
        self.ttft_target.set(ttft_target_s)
        self.tpot_target.set(tpot_target_s)

    def set_limits(self, min_decode_sms: int, max_decode_sms: int, max_waiting: int) -> None:
        self.min_decode_sms.set(min_decode_sms)
        self.max_decode_sms.set(max_decode_sms)
        self.max_waiting.set(max_waiting)

    def arrived(self) -> None:
        self.arrived_total.inc(1)

    def first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def inter_token(self, gap_s: float) -> None:
        self.itl.observe(gap_s)

    def generated(self, num_tokens: int) -> None:
        self.generation_tokens.inc(num_tokens)

    def finished(self, reason: str, e2e_s: float, ttft_s: float | None = None, num_output_tokens: int = 0,
                 num_prompt_tokens: int = 0) -> None:
        self.e2e.observe(e2e_s)
        self.success.inc(1, tags={"finished_reason": reason})
        if ttft_s is not None:
            is_met = self.meets_slo(ttft_s, e2e_s, num_output_tokens, num_prompt_tokens)
            self.slo_total.inc(1, tags={"slo_met": str(is_met).lower()})

    def meets_slo(self, ttft_s: float, e2e_s: float, num_output_tokens: int, num_prompt_tokens: int = 0) -> bool:
        """Both targets met: TTFT (max(the floor, per-token target x `num_prompt_tokens`) when a per-token
        target is set; 0 prompt tokens: the floor), and TPOT = (e2e - TTFT) / (tokens - 1) (DistServe's
        attainment)."""
        tpot_s = (e2e_s - ttft_s) / (num_output_tokens - 1) if num_output_tokens > 1 else 0.0
        return ttft_s <= self.targets.ttft_target_s(num_prompt_tokens) and tpot_s <= self.targets.tpot_s

    def rejected(self) -> None:
        self.rejected_total.inc(1)

    def observe_stats(self, stats: Any) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_usage)
        extra = getattr(stats, "extra", None) or {}
        split = extra.get("split")
        if split:
            # the entries each side acked; in overlap mode (split_switch) they may briefly sum past the GPU's SMs
            self.decode_sms.set(split["decode_sms_now"])
            self.prefill_sms.set(split["prefill_sms_now"])
        decode = extra.get("decode")
        if decode and decode.get("step", 0) > 0:
            self.decode_step.set(decode["step_time_us"] / 1e6)
            if decode.get("predicted_step_us", 0) > 0:  # the performance model's, for the step just published
                self.predicted_decode_step.set(decode["predicted_step_us"] / 1e6)
        if stats.predicted_ttft_s is not None:
            self.predicted_ttft.set(stats.predicted_ttft_s)
        if extra.get("gc"):
            self.observe_gc(extra["gc"])
        if "num_graph_captures_serving" in extra:
            self.captures_serving.set(extra["num_graph_captures_serving"])
        policy = extra.get("policy")
        if policy and policy.get("num_decisions", 0) > 0:
            self.decision_cost.set(policy["decision_cost_us"] / 1e6)
        for reason, count in ((policy or {}).get("decisions_by_reason") or {}).items():
            added = count - self._decisions_seen.get(reason, 0)
            if added > 0:  # the engine's counts are cumulative; a new engine starts them again (never negative)
                self.decisions.inc(added, tags={"reason": reason})
            self._decisions_seen[reason] = count

    def observe_gc(self, totals: dict[str, dict[str, float]]) -> None:
        """Each process's garbage collections so far ({process: {"seconds", "collections"}}, cumulative: what was
        added since the last call goes to the counters; a restarted worker's smaller totals, either of them, start
        again)."""
        for process, total in totals.items():
            seconds, count = float(total["seconds"]), int(total["collections"])
            seen_s, seen_n = self._gc_seen.get(process, (0.0, 0))
            if count < seen_n or seconds < seen_s:  # a new process under the same role
                seen_s, seen_n = 0.0, 0
            tags = {"process": process}
            if seconds > seen_s:
                self.gc_seconds.inc(seconds - seen_s, tags=tags)
            if count > seen_n:
                self.gc_collections.inc(count - seen_n, tags=tags)
            self._gc_seen[process] = (max(seconds, seen_s), max(count, seen_n))

    def observe_steps(self, records: dict[str, Any]) -> None:
        """Per-step records drained from the engine (LLMEngine.drain_step_records)."""
        for phase in ("prefill", "decode"):
            tags = {"phase": phase}
            for measured_s, predicted_s, _ in records.get(phase, []):
                if measured_s <= 0:
                    continue
                self.step.observe(measured_s, tags=tags)
                if predicted_s > 0:
                    self.step_predicted.observe(predicted_s, tags=tags)
                    self.step_error.observe(abs(predicted_s - measured_s) / measured_s, tags=tags)
        for seconds in records.get("switch_s", []):
            self.switch.observe(seconds)
        for seconds in records.get("switch_drain_s", []):
            self.switch_drain.observe(seconds)
        for seconds in records.get("handoff_s", []):
            self.handoff.observe(seconds)


class ControllerMetrics:
    """The cluster controller's decisions (one set per application)."""

    def __init__(self, app_name: str) -> None:
        from ray.util import metrics as m

        tags = {"app": app_name}
        self.decisions = m.Counter("bullet_controller_decisions", "Controller decisions by admission mode.",
                                   tag_keys=("app", "mode"))
        self.num_replicas = m.Gauge("bullet_controller_num_replicas", "Engine replicas the controller asks for.",
                                    tag_keys=("app",))
        self.rate = m.Gauge("bullet_controller_arrival_rate_rps", "Arrival rate, measured and forecast (req/s).",
                            tag_keys=("app", "kind"))
        self.demand = m.Gauge("bullet_controller_demand_tokens_per_s", "Prompt + output tokens per second, measured "
                              "and forecast.", tag_keys=("app", "kind"))
        self.capacity = m.Gauge("bullet_controller_capacity_tokens_per_s", "Tokens per second the decided replicas "
                                "serve within SLO.", tag_keys=("app",))
        self.mean_tokens = m.Gauge("bullet_controller_mean_tokens", "Mean prompt / output length, measured and "
                                   "forecast.", tag_keys=("app", "phase", "kind"))
        self.attainment = m.Gauge("bullet_controller_slo_attainment", "Share of requests meeting both targets over "
                                  "the last interval.", tag_keys=("app",))
        self.push_failures = m.Counter("bullet_controller_push_failures", "Decisions that did not reach the engines.",
                                       tag_keys=("app",))
        self.bound = m.Gauge("bullet_controller_decode_sms_bound", "Decode SM bounds decided per engine.",
                             tag_keys=("app", "engine", "bound"))
        for metric in (self.decisions, self.num_replicas, self.rate, self.demand, self.capacity, self.mean_tokens,
                       self.attainment, self.push_failures, self.bound):
            metric.set_default_tags(tags)


class NodeMetrics:
    """A node agent's telemetry (NVML; nothing on a node without GPUs but the MPS state)."""

    def __init__(self, node: str) -> None:
        from ray.util import metrics as m

        keys = ("node", "gpu")
        self.util = m.Gauge("bullet_node_gpu_utilization_perc", "Share of time a kernel ran (0..1).", tag_keys=keys)
        self.memory = m.Gauge("bullet_node_gpu_memory_used_bytes", "GPU memory in use.", tag_keys=keys)
        self.power = m.Gauge("bullet_node_gpu_power_watts", "GPU power draw (W).", tag_keys=keys)
        self.mps = m.Gauge("bullet_node_mps_running", "1 when the node's MPS daemon answers.", tag_keys=("node",))
        for metric in (self.util, self.memory, self.power, self.mps):
            metric.set_default_tags({"node": node})
