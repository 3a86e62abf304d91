"""The application's typed arguments (what `serve run deploy/<file>.yaml` passes to `build_app`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bullet_ray.config import EngineConfig, ladder_problem
from bullet_ray.control.config import ControllerConfig

GRPC_SERVICER_FUNCTION = "bullet_ray.serve.proto.generate_pb2_grpc.add_GeneratorServicer_to_server"


class EngineArgs(BaseModel):
    """Engine settings of every engine replica; see bullet_ray.config.EngineConfig for each field."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("smollm2-135m-instruct", description="HF folder, .gguf file, dummy:<preset>, or the embedded default")
    device: str = Field("cpu", description="'cpu' or 'cuda'")
    dtype: str = Field("auto", description="auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16")
    schedule: Literal["bullet", "chunked", "static"] = Field("bullet", description="prefill/decode schedule")
    attention_backend: str = Field("auto", description="auto, torch or flashinfer")
    block_size: int = Field(16, ge=1, description="tokens per KV block")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per engine; null: from kv_cache_memory_gb")
    kv_cache_memory_gb: float = Field(0.25, gt=0, description="KV pool size when num_kv_blocks is null (GiB)")
    max_model_len: int | None = Field(None, ge=2, description="longest prompt + output")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one decode batch")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of a prefill / hybrid batch")
    seed: int = Field(0, description="seed of dummy weights")
    enforce_eager: bool = Field(False, description="no CUDA graphs")
    piecewise_graph_tokens: int | None = Field(None, ge=0, description="largest step (tokens) with prompt tokens "
                                               "that runs through piecewise CUDA graphs (attention eager between "
                                               "them); 0: off; null: the token budget on the chunked schedule, at "
                                               "most 2048 on a prefill side (bullet, static)")
    piecewise_buckets: Literal["tuned", "fixed"] = Field(
        "tuned", description="token buckets of the piecewise graphs above 512 tokens: tuned (chosen at start from "
                             "the GPU's own GEMM times) or fixed (every 64 / 128 / 256 tokens)")
    async_scheduling: bool | None = Field(None, description="plan and launch a step that runs through CUDA graphs "
                                          "while the last step runs (null: on for GPU, off for CPU; docs/gpu.md)")
    partition: str = Field("auto", description="SM partition backend: auto, green, mps, none")
    kv_watermark: float = Field(0.01, ge=0, le=0.5, description="fraction of KV blocks prefill leaves free for "
                                                                "running sequences to grow into")
    static_decode_sms: int | None = Field(None, ge=1, description="decode SMs of the static schedule's fixed "
                                                                  "split; null: half the GPU")
    decode_sm_counts: list[Annotated[int, Field(strict=True, ge=1)]] | None = Field(
        None, min_length=1, description="the SM split ladder of the bullet and static schedules: decode SM counts, "
                                        "ascending, prefill taking the rest (on a GPU rounded up to its granularity, "
                                        "8 SMs on Hopper); null: 16 to the GPU's SMs - 16 in steps of 8")
    split_policy: Literal["auto", "slo", "fixed"] = Field(
        "auto", description="SM split of the bullet schedule: fixed (the middle of the ladder), slo (moved "
                            "step by step to meet the ttft/tpot targets; what the GPU deployments in deploy/ "
                            "set, with ttft_margin_ms 50), auto (fixed: the engine's default)")
    prefill_layer_groups: int = Field(1, ge=1, le=256, description="layer-wise prefill: a long prefill batch runs "
                                      "in this many layer groups and the SM split may move between them (1: off)")
    prefill_layer_group_min_tokens: int = Field(2048, ge=1, description="smallest prefill batch (new tokens) "
                                                "that runs layer-wise when prefill_layer_groups > 1")
    gc_freeze: bool = Field(True, description="each worker, and the engine front (the Serve replica), freezes its "
                            "Python heap once started (gc.freeze), so that no garbage collection walks the model's, "
                            "graphs' and Serve's start-up objects while serving")
    decode_pieces: int = Field(1, ge=1, le=256, description="decode steps (split_policy slo, split_switch overlap) "
                               "as this many CUDA graphs of layers launched just in time, the split followed between "
                               "them (1: one graph a step)")
    prefill_plan_lead_ms: float | None = Field(10.0, ge=0, description="the prefill worker (GPU) plans its next "
                                               "batch this long (ms) before the step in flight is predicted to "
                                               "end, taking arrivals meanwhile; null: at once, as before the "
                                               "thirty-first session")
    prefill_idle_decide_ms: float | None = Field(
        None, gt=0, le=500, description="split policy: while the prefill worker idles and decode runs, it wakes this "
                                        "often (ms) to decide the split again after decode's steps; null: on a "
                                        "message or every 0.5 s (decode may sit on prefill's last entry that long)")
    split_switch: Literal["disjoint", "overlap"] = Field(
        "overlap", description="how the two sides move to a new SM split: overlap (the default: each side moves "
                               "at its next launch; the growing side shares its new SMs with the other's step in "
                               "flight), disjoint (the shrinking side finishes its step in flight first, the "
                               "growing side waits for it: their SMs never overlap, switches take a step longer); "
                               "applies to every split request, the slo policy's and a manual request_split")
    handoff: Literal["front", "direct"] = Field(
        "front", description="how a prefilled sequence reaches the decode worker: front (relayed by the engine "
                             "front, the default) or direct (prefill worker to decode worker over their own socket)")
    mixed_fallback_tokens: int | None = Field(None, ge=1, description="bullet with split_policy slo: once this "
                                              "many prompt tokens wait while decode runs, the decode worker "
                                              "takes the queued prompts in chunks into its steps (chunked "
                                              "prefill on the whole GPU) until a quarter of it is left; "
                                              "null: off (it has not paid on the H100: serve_h100_m2n)")
    mixed_chunk_tokens: int = Field(2048, ge=1, description="token budget of a decode step in the mixed "
                                    "fallback (decode rows and prompt chunks)")
    ttft_target_ms: float = Field(500.0, gt=0, description="TTFT target of the split policy and the SLO "
                                                          "metrics (ms; the floor under a per-prompt-token one)")
    tpot_target_ms: float = Field(25.0, gt=0, description="TPOT target of the split policy (ms)")
    ttft_target_ms_per_prompt_token: float | None = Field(
        None, gt=0, description="Bullet's per-prompt-token TTFT target (ms per prompt token; its presets: ShareGPT "
                                "3, Azure code and arXiv 1.5): a request's TTFT target is max(ttft_target_ms, this "
                                "x its prompt tokens), for the split policy and the SLO metrics; null: off")
    ttft_margin_ms: float = Field(0.0, ge=0, description="the split policy plans as if each TTFT target were this "
                                  "much shorter (ms; < ttft_target_ms unless per prompt token; 0: off): headroom for "
                                  "prediction error and the time outside the workers; the SLO metrics and admission "
                                  "keep the real targets; ttft_margin_scope says what plans with it")
    ttft_margin_scope: Literal["all", "order"] = Field(
        "all", description="what plans with ttft_margin_ms: all (the prefill queue's order, the batches' fit and "
                           "the split rule's TTFT risk and backlog; what the H200 A/B measured) or order (the "
                           "order and the batches' fit only: the split rule judges against the real targets)")
    ttft_fallback_ms: float | None = Field(
        None, gt=0, description="a second, later TTFT target (ms, > ttft_target_ms; e.g. the relaxed SLO's 1000): the "
                                "prefill queue's order serves a request that can no longer make its target by this "
                                "one, in the slack the others leave, instead of after everyone; null: off")
    prefill_order: Literal["least_slack", "max_on_time", "fallback_first"] = Field(
        "least_slack", description="split policy: how the prefill queue is ordered: least_slack (the requests that "
                                   "can each still make their TTFT target, least slack first), max_on_time (only "
                                   "the most of them that make their targets together; the longest prompts are "
                                   "given up first: Moore-Hodgson; what the GPU deployments ship) or fallback_first "
                                   "(the most that make ttft_fallback_ms together, as many of them as can within "
                                   "their target; needs ttft_fallback_ms)")
    prefill_backlog_batch_tokens: int | None = Field(
        None, ge=1, description="split policy: while a queued request misses its TTFT target whatever the split "
                                "(a backlog), prefill batches grow to this many tokens (<= max_num_batched_tokens) "
                                "instead of stopping where throughput saturates; null: off (one GPU sample: it lost "
                                "at strict)")
    prefill_saturation_share: float = Field(
        0.95, gt=0, le=1, description="split policy: a prefill batch stops growing at the fewest tokens whose "
                                      "throughput the performance model puts within this share of the best; higher: "
                                      "larger batches (more tokens/s, a batch's first requests wait longer)")
    prefill_gemm: Literal["auto", "cublas", "cublaslt", "cublaslt-all"] = Field(
        "auto", description="the prefilling worker's projection GEMMs (GPU): cublas (PyTorch's), cublaslt (at "
                            "start, cuBLASLt's heuristic algorithms timed per partition where cuBLAS's grid wastes "
                            "SM-rounds, or on the whole GPU for chunked, per shape and token count, the fastest kept "
                            "and cached: bullet_ray.engine.lt_gemm), cublaslt-all (also a bounded enumeration of "
                            "1x1 / 1x2 cluster configurations), auto (cublaslt on the bullet and static schedules "
                            "in bfloat16 on a GPU, where it raised goodput 1.14-1.16x on an H200; cublas elsewhere)")
    split_rule: dict[str, Any] | None = Field(None, description="settings of the split rule (aim, backlog_aim, "
                                              "idle_decode, max_shrink, ...: bullet_ray.policy.split.SplitSettings, "
                                              "docs/policy.md); null: its defaults")
    idle_poll_ms: float = Field(2.0, gt=0, description="how often an idle worker polls for work (ms)")
    step_log_path: str | None = Field(None, description="append one JSON line per worker step and split "
                                                        "decision to this file (benchmarks/plot_steps.py); "
                                                        "null: no log")
    profile_dir: str | None = Field(None, description="profile a window of every worker's steps (host cProfile, "
                                                      "torch.profiler) into this folder; null: off")
    profile_start_step: int = Field(200, ge=0, description="first profiled step of each worker")
    profile_num_steps: int = Field(50, ge=1, description="steps in the profiled window")
    runtime_dir: str | None = Field(None, description="folder for the engine's socket and shared-memory files; "
                                                      "null: a fresh one under /dev/shm")

    @field_validator("decode_sm_counts")
    @classmethod
    def _ascending_ladder(cls, counts: list[int] | None) -> list[int] | None:
        """A ladder out of order fails at `serve run` (build_app), not later in every replica's EngineConfig."""
        problem = None if counts is None else ladder_problem(counts)
        if problem is not None:
            raise ValueError(problem)
        return counts

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump())


class BulletAppConfig(BaseModel):
    """Arguments of `bullet_ray.serve:build_app`."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineArgs = Field(default_factory=EngineArgs)  # type: ignore[arg-type]
    served_model_name: str | None = Field(None, description="name clients use in 'model'; default: engine.model")
    num_engines: int = Field(1, ge=1, description="engine replicas: one per GPU (on CPU, one per process pair)")
    num_ingress_replicas: int = Field(
        1, ge=1, description="replicas of the HTTP/gRPC ingress (CPU only); raise it with the number of nodes "
                             "serving traffic so the ingress is not the bottleneck")
    colocate_ingress: bool = Field(
        False, description="run the HTTP/gRPC ingress inside each engine replica (one deployment, BulletEngine): "
                           "tokens reach the HTTP response without a Ray hop per token; requests are spread over "
                           "the replicas by Serve's proxy with the engine's router. num_ingress_replicas is unused")
    ingress_num_cpus: float = Field(
        1.0, ge=0, description="CPUs reserved for each ingress replica (Serve's default, 1); the controller's engine "
                               "budget leaves num_ingress_replicas x this aside. Set it here, not in the YAML's "
                               "`deployments:` section, which the budget does not see. Unused with colocate_ingress")
    worker_launcher: Literal["ray", "process"] = Field(
        "ray", description="ray: prefill/decode workers are Ray actors in the replica's placement group; "
                           "process: child processes of the replica")
    accelerator_resource: str | None = Field(
        None, description="Ray resource one engine occupies (a GPU); default 'GPU' on cuda, none on CPU. "
                          "Tests use a custom resource standing in for GPUs.")
    mps: Literal["auto", "off"] = Field(
        "auto", description="auto: on GPU with a two-process schedule (bullet, static) each engine replica makes "
                            "sure its node's MPS daemon `mps_name` runs (starting it if not) and runs its prefill "
                            "and decode workers as its clients, so they execute concurrently; off: no MPS")
    mps_name: str = Field("bullet_ray", description="the node's MPS daemon (pipe folder /tmp/bullet_ray/mps/<name>); "
                                                  "left running when Serve stops: `bash deploy/mps/stop.sh <name>`")
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each engine replica process")
    worker_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each worker actor")
    max_waiting_per_engine: int = Field(
        64, ge=1, description="admission: requests an engine holds without a first token (its queue) before "
                              "it answers 429; runtime-tunable through user_config")
    admission_ttft_s: float | None = Field(
        None, gt=0, description="admission: answer 429 when the engine's predicted TTFT of a new request exceeds "
                                "this target x (1 + admission_margin); null: queue length only. Runtime-tunable")
    admission_ttft_ms_per_prompt_token: float | None = Field(
        None, gt=0, description="admission under Bullet's per-prompt-token TTFT targets: a request's TTFT bound is "
                                "max(admission_ttft_s, this x its prompt tokens / 1000) x (1 + admission_margin) "
                                "(the replica counts the prompt's tokens first when that length can change "
                                "the answer); null: off. "
                                "Runtime-tunable")
    admission_tpot_s: float | None = Field(
        None, gt=0, description="admission: answer 429 while the engine's recent decode step time (the TPOT its "
                                "running requests get) exceeds this target x (1 + admission_margin); null: off. "
                                "Runtime-tunable")
    admission_margin: float = Field(
        0.0, ge=0, description="admission: slack over admission_ttft_s / admission_tpot_s before refusing, as a "
                               "fraction")
    max_ongoing_requests: int = Field(256, ge=1, description="Serve's cap of concurrent requests per engine replica")
    retry_after_s: int = Field(1, ge=1, description="Retry-After (s) sent with 429")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none (less where the "
                                    "prompt leaves less of max_model_len)")
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer tokens; empty: no auth")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get 413 (chunked ones once "
                                   "past it)")
    controller: ControllerConfig | None = Field(
        None, description="cluster controller (bullet_ray.control): forecasts load, sets engine replicas within a GPU "
                          "budget through Serve's autoscaler, pushes split bounds, SLO targets and admission; "
                          "null: none, num_engines fixed")
    # shutdown and recovery ------------------------------------------------------------------------
    drain_grace_s: float = Field(
        30.0, ge=0, description="when an engine replica stops (serve shutdown, scale-down, redeploy, Ctrl-C of "
                                "`serve run`), how long its running requests may finish (Serve's "
                                "graceful_shutdown_timeout_s); requests still running then end with an error "
                                "event. The ingress waits this + 5 s so it can deliver those events")
    health_check_period_s: float = Field(
        2.0, gt=0, description="how often Serve checks each engine replica; a replica whose engine died (a worker "
                               "crashed) fails the check and is replaced after 3 failures in a row")
    health_check_timeout_s: float = Field(
        10.0, gt=0, description="a health check not answered in this time counts as failed")
    grpc_enabled: bool = Field(
        True, description="answer the gRPC Generate call (Serve's gRPC proxy must be on: grpc_options in the "
                          "YAML with grpc_servicer_functions: [" + GRPC_SERVICER_FUNCTION + "])")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def uses_mps(self) -> bool:
        """Whether this app's workers run as clients of the node's MPS daemon."""
        return (self.mps == "auto" and self.engine.device.startswith("cuda")
                and self.engine.schedule in ("bullet", "static") and self.worker_launcher == "ray")

    @property
    def ingress_cpus(self) -> float:
        """CPUs the ingress deployment reserves in all; none with colocate_ingress (its routes run in the engines)."""
        return 0.0 if self.colocate_ingress else self.num_ingress_replicas * self.ingress_num_cpus

    @property
    def accelerator(self) -> str | None:
        if self.accelerator_resource is not None:
            return self.accelerator_resource
        return "GPU" if self.engine.device.startswith("cuda") else None
