"""The engine replica: one per GPU. A CPU-only Serve replica that owns an LLMEngine front (tokenizer,
request table, token streams) and the engine's prefill/decode worker actors."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve

from bullet_ray.engine.gc_pauses import GcPauses, freeze_heap
from bullet_ray.engine.outputs import RequestOutput
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import EngineDeadError, InvalidRequest, InvalidSamplingParams
from bullet_ray.serve.admission import AdmissionSettings
from bullet_ray.serve.config import BulletAppConfig

logger = logging.getLogger(__name__)

DEAD_TTFT_S = 1e9  # what a replica whose engine died reports to the router: rank it last


@dataclass(frozen=True)
class GenerateError:
    """Yielded instead of outputs when a request cannot run; the ingress turns it into an HTTP error."""

    status: int
    message: str
    err_type: str
    param: str | None = None
    retry_after_s: int | None = None


class EngineReplica:
    """Serve deployment class; `build_app` wraps it with serve.deployment options."""

    def __init__(self, app_config: dict[str, Any], engine_factory: Any = None) -> None:
        from bullet_ray.engine.launcher import ProcessLauncher
        from bullet_ray.engine.llm_engine import LLMEngine
        from bullet_ray.serve.workers import RayActorLauncher

        self.cfg = BulletAppConfig(**app_config)
        engine_config = self.cfg.engine.to_engine_config()
        self.replica_id = _replica_id()
        gpu_id = "cpu"
        if engine_factory is not None:  # tests pass a mock engine that implements EngineClient
            self.engine = engine_factory(self.cfg)
        else:
            launcher = (RayActorLauncher(self.cfg.accelerator, self.cfg.worker_num_cpus, env=self._mps_env())
                        if self.cfg.worker_launcher == "ray" else ProcessLauncher())
            self.engine = LLMEngine(engine_config, launcher=launcher,
                                    served_model_name=self.cfg.model_name)
            if isinstance(launcher, RayActorLauncher) and self.cfg.engine.device.startswith("cuda"):
                placed = launcher.describe()
                uuids = {info.get("gpu_uuid") for info in placed.values()}
                if len(uuids) != 1 or None in uuids:
                    raise EngineDeadError(f"prefill and decode workers are not on one GPU: {placed}")
                gpu_id = str(uuids.pop())
        from bullet_ray.metrics import EngineMetrics

        targets = engine_config.slo_targets()
        self.metrics = EngineMetrics(self.cfg.model_name, self.replica_id, gpu_id, targets.ttft_s, targets.tpot_s,
                                     targets.ttft_per_token_s)
        self.admission = AdmissionSettings(self.cfg.max_waiting_per_engine, self.cfg.admission_ttft_s,
                                           self.cfg.admission_margin, self.cfg.retry_after_s,
                                           self.cfg.admission_tpot_s, self.cfg.admission_ttft_ms_per_prompt_token)
        self.num_requests_total = 0
        self.num_rejected_total = 0
        # this process (the engine front) freezes its heap once the engine has started, as each worker does
        # (engine.gc_freeze), and times its collections (the gc_pause metrics); a test's mock engine leaves the
        # test process alone
        self.gc_pauses: GcPauses | None = None
        self.gc_frozen: int | None = None
        if engine_factory is None:
            if self.cfg.engine.gc_freeze:
                froze_at = time.perf_counter()
                self.gc_frozen = freeze_heap()
                logger.info("engine front: heap frozen, %d objects out of the collector's reach (%.3f s)",
                            self.gc_frozen, time.perf_counter() - froze_at)
            self.gc_pauses = GcPauses()  # from here on: the freeze's own full collection is start-up, not serving
            self.gc_pauses.install()

    def _mps_env(self) -> dict[str, str]:
        """Start (or find) this node's MPS daemon when the workers should be its clients; their environment."""
        if not self.cfg.uses_mps:
            return {}
        from bullet_ray.gpu.mps import MpsDaemon, MpsError

        daemon = MpsDaemon(self.cfg.mps_name)
        try:
            daemon.start()  # a no-op when another replica on this node started it already
        except MpsError:
            if not daemon.status().is_running:  # lost a race with a replica starting it at the same time: fine
                raise
        return daemon.env()

    # Serve hooks ------------------------------------------------------------------------------------
    def __del__(self) -> None:
        """Serve calls this when the replica stops, after its running requests drained (or drain_grace_s
        passed): stop the workers, remove the shared memory. If Serve kills the replica instead (the grace
        ran out), the engine's watchdog does the same."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        pauses = getattr(self, "gc_pauses", None)
        if pauses is not None:
            pauses.uninstall()

    def check_health(self) -> None:
        self.engine.check_health()

    def _is_healthy(self) -> bool:
        try:
            self.engine.check_health()
        except EngineDeadError:
            return False
        return True

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Runtime knobs (the deployment's user_config): max_waiting_per_engine, admission_ttft_s,
        admission_tpot_s, admission_ttft_ms_per_prompt_token, admission_margin, retry_after_s. Unknown keys are an
        error naming them."""
        from bullet_ray.control.apply import reconfigure_admission

        reconfigure_admission(self, user_config)  # the controller's later decisions keep it
        logger.info("admission settings now %s", self.admission)

    def apply_policy(self, decision: dict[str, Any]) -> dict[str, Any]:
        """A cluster controller decision (bullet_ray.control.decide.Decision as a dict): this replica's split
        bounds, SLO targets and admission. Returns what is in force now (bullet_ray.control.apply)."""
        from bullet_ray.control.apply import apply_decision

        return apply_decision(self, decision)

    def record_routing_stats(self) -> dict[str, Any]:
        if not self._is_healthy():
            # the router ranks this replica last until Serve replaces it (its requests would get 503)
            return {"predicted_ttft_s": DEAD_TTFT_S, "num_waiting": DEAD_TTFT_S, "num_running": 0, "kv_usage": 1.0,
                    "is_dead": True}
        stats = self.engine.stats()
        self.metrics.observe_stats(stats)
        if self.gc_pauses is not None:
            self.metrics.observe_gc({"front": self._front_gc()})
        drain = getattr(self.engine, "drain_step_records", None)  # the mock engine has none
        if drain is not None:
            self.metrics.observe_steps(drain())
        return {"predicted_ttft_s": stats.predicted_ttft_s, "num_waiting": stats.num_waiting,
                "num_running": stats.num_running, "kv_usage": stats.kv_usage}

    # API --------------------------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        return {"model_name": self.engine.model_name, "max_model_len": self.engine.max_model_len,
                "replica_id": self.replica_id}

    def tokenize(self, request: dict[str, Any]) -> dict[str, Any]:
        """POST /tokenize: the ids the engine would run for {prompt} or {messages} (the chat template with its
        generation prompt), with the context length; or {"error": GenerateError} naming the field."""
        try:
            ids = self.engine.prompt_ids(self._prompt(request))
        except InvalidRequest as e:
            return {"error": GenerateError(400, str(e), "invalid_request_error", e.field)}
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    def detokenize(self, tokens: list[int]) -> dict[str, Any]:
        """POST /detokenize: the text of `tokens` (ids checked against the vocabulary; a model without a tokenizer
        gives each id as " <id>", as its streams do), or {"error": GenerateError}."""
        if not tokens:
            return {"prompt": ""}
        try:
            ids = self.engine.prompt_ids(list(tokens))
        except InvalidRequest as e:  # an id outside the vocabulary
            return {"error": GenerateError(400, str(e), "invalid_request_error", "tokens")}
        from bullet_ray.engine.stop_checker import TokenIdText

        tokenizer = self.engine.tokenizer if self.engine.tokenizer is not None else TokenIdText()
        return {"prompt": tokenizer.decode(ids)}

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (picklable), or None; the ingress decodes logprob tokens with it."""
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        s = self.engine.stats()
        return {"num_waiting": s.num_waiting, "num_running": s.num_running, "num_kv_blocks": s.num_kv_blocks,
                "num_free_kv_blocks": s.num_free_kv_blocks, "num_preemptions": s.num_preemptions,
                "replica_id": self.replica_id,
                "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
                "num_requests_total": self.num_requests_total, "num_rejected_total": self.num_rejected_total,
                "predicted_ttft_s": s.predicted_ttft_s, "admission": dataclasses.asdict(self.admission),
                "handoff": s.extra.get("handoff"), "gc": self._gc_info(s), **self._process_info()}

    def _front_gc(self) -> dict[str, float]:
        pauses = self.gc_pauses
        assert pauses is not None
        return {"seconds": pauses.total_s, "collections": pauses.num_collections}

    def _gc_info(self, stats: Any) -> dict[str, Any]:
        """Garbage collections so far per process (front, and each worker as its last step left them) and the
        front's heap freeze (objects frozen; None: none)."""
        info = dict((getattr(stats, "extra", None) or {}).get("gc") or {})
        if self.gc_pauses is not None:
            info["front"] = self._front_gc()
        return {"processes": info, "front_frozen": self.gc_frozen}

    def _process_info(self) -> dict[str, Any]:
        """Where this engine's memory and processes are (operators, the chaos tests, benchmarks/soak.py)."""
        workers = getattr(self.engine, "worker_info", {})
        return {"pid": os.getpid(), "runtime_dir": getattr(self.engine, "runtime_dir", None),
                "worker_pids": {role: info.get("pid") for role, info in workers.items()}}

    def _prompt(self, request: dict[str, Any]) -> str | list[int]:
        if request.get("messages") is None:
            return request["prompt"]
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("this model has no chat template: send a prompt (/v1/completions) instead of messages",
                                 "messages")
        try:
            return list(tokenizer.apply_chat_template(request["messages"], add_generation_prompt=True,
                                                      tokenize=True, return_dict=False))
        except Exception as e:  # noqa: BLE001 - a template's own checks (jinja2's raise_exception, a bad role)
            # e.g. a template that wants user and assistant turns to alternate, or has no system role
            raise InvalidRequest(f"the model's chat template refused these messages: {e}", "messages") from e

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[RequestOutput | GenerateError]:
        """Stream a request's outputs: request = {prompt | messages, params: SamplingParams, request_id}."""
        params: SamplingParams = request["params"]
        self.num_requests_total += 1
        self.metrics.arrived()
        start = time.monotonic()
        prompt: str | list[int] | None = None
        num_prompt_tokens: int | None = None
        stats = self.engine.stats()
        if self.admission.length_decides(stats):  # a per-prompt-token TTFT bound the prompt's length can move
            try:
                ids = self.engine.prompt_ids(self._prompt(request))
            except InvalidRequest as e:
                yield GenerateError(400, str(e), "invalid_request_error", e.field)
                return
            prompt, num_prompt_tokens = ids, len(ids)
        refusal = self.admission.refusal(stats, num_prompt_tokens) if num_prompt_tokens is not None \
            else self.admission.refusal_uncounted(stats)
        if refusal is not None:
            self.num_rejected_total += 1
            self.metrics.rejected()
            yield GenerateError(429, f"every engine is saturated ({refusal}); retry later", "rate_limit_error",
                                retry_after_s=self.admission.retry_after_s)
            return
        last_token_s: float | None = None
        ttft_s: float | None = None
        try:
            if prompt is None:
                prompt = self._prompt(request)
            stream = self.engine.stream_async(prompt, params, request.get("request_id") or uuid.uuid4().hex)
            async for out in stream:
                now = time.monotonic()
                if out.token_ids_delta:
                    if last_token_s is None:
                        ttft_s = now - start
                        self.metrics.first_token(ttft_s, out.num_prompt_tokens)
                    else:
                        self.metrics.inter_token(now - last_token_s)
                    last_token_s = now
                    self.metrics.generated(len(out.token_ids_delta))
                if out.finished:
                    self.metrics.finished(out.finish_reason or "stop", now - start, ttft_s, out.num_output_tokens,
                                          out.num_prompt_tokens)
                yield out
        except InvalidSamplingParams as e:
            yield GenerateError(400, str(e), "invalid_request_error", e.field)
        except InvalidRequest as e:
            status = 413 if e.code == "context_length_exceeded" else 400
            yield GenerateError(status, str(e), "invalid_request_error", e.field)
        except EngineDeadError as e:
            # Serve replaces this replica (its health check fails); the client may retry meanwhile
            yield GenerateError(503, f"engine unavailable: {e}", "server_error",
                                retry_after_s=self.admission.retry_after_s)


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit tests)
        return "local"
