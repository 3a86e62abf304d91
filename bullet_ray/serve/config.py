"""The application's typed arguments (what `serve run deploy/<file>.yaml` passes to `build_app`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from bullet_ray.config import EngineConfig


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
    partition: str = Field("auto", description="SM partition backend: auto, green, mps, none")

    def to_engine_config(self) -> EngineConfig:
        return EngineConfig(**self.model_dump())


class BulletAppConfig(BaseModel):
    """Arguments of `bullet_ray.serve:build_app`."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineArgs = Field(default_factory=EngineArgs)  # type: ignore[arg-type]
    served_model_name: str | None = Field(None, description="name clients use in 'model'; default: engine.model")
    num_engines: int = Field(1, ge=1, description="engine replicas: one per GPU (on CPU, one per process pair)")
    worker_launcher: Literal["ray", "process"] = Field(
        "ray", description="ray: prefill/decode workers are Ray actors in the replica's placement group; "
                           "process: child processes of the replica")
    accelerator_resource: str | None = Field(
        None, description="Ray resource one engine occupies (a GPU); default 'GPU' on cuda, none on CPU. "
                          "Tests use a custom resource standing in for GPUs.")
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each engine replica process")
    worker_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved for each worker actor")
    max_waiting_per_engine: int = Field(
        64, ge=1, description="requests an engine holds without a first token before it answers 429")
    max_ongoing_requests: int = Field(256, ge=1, description="Serve's cap of concurrent requests per engine replica")
    retry_after_s: int = Field(1, ge=1, description="Retry-After (s) sent with 429")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    api_keys: list[str] = Field(default_factory=list, description="accepted Bearer tokens; empty: no auth")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get 413")
    route_prefix: str = Field("/", description="HTTP route prefix of the ingress")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model

    @property
    def accelerator(self) -> str | None:
        if self.accelerator_resource is not None:
            return self.accelerator_resource
        return "GPU" if self.engine.device.startswith("cuda") else None
