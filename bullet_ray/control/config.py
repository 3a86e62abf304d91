"""The `controller:` section of the application's YAML args (pydantic, validated at the edge)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ControllerConfig(BaseModel):
    """Settings of the cluster controller of one application (bullet_ray.control.controller)."""

    model_config = ConfigDict(extra="forbid")

    app_name: str = Field("bullet", description="the Serve application's name (the YAML's `name:`); the controller "
                                                "pushes to its BulletEngine deployment")
    interval_s: float = Field(5.0, gt=0, description="seconds between two decisions")
    horizon_s: float = Field(30.0, ge=0, description="how far ahead the load forecast looks (s); at least the time "
                                                     "an engine replica takes to start, so capacity is there first")
    prometheus_url: str | None = Field(None, description="Prometheus server to read (http://host:9090); null: "
                                                         "scrape every Ray node's metrics export port directly")
    min_engines: int = Field(1, ge=1, description="fewest engine replicas")
    max_engines: int | None = Field(
        None, ge=1, description="engine budget: most engine replicas; null: as many as the cluster holds (its CPUs "
                                "less the ingress's, num_ingress_replicas x ingress_num_cpus (none with colocate_ingress), over the CPUs one "
                                "engine reserves, engine_num_cpus + 2 x worker_num_cpus, at least one; with an "
                                "accelerator at most its count), never fewer than num_engines")
    engine_capacity_tokens_s: float = Field(
        20000.0, gt=0, description="prompt + output tokens per second one engine serves within its SLOs (measure it "
                                   "with the bench tool's rate sweep on your GPU and model)")
    target_utilization: float = Field(0.8, gt=0, le=1, description="share of capacity the replica count aims at")
    scale_down_after: int = Field(6, ge=1, description="decisions in a row wanting fewer replicas before scaling down")
    min_decode_sms: int | None = Field(None, ge=1, description="operator's floor of decode SMs; null: the ladder's")
    max_decode_sms: int | None = Field(None, ge=1, description="operator's ceiling of decode SMs; null: the ladder's")
    split_step_sms: int = Field(8, ge=1, description="SMs a bound moves per decision when a target is missed")
    ttft_target_ms: float | None = Field(None, gt=0, description="TTFT target pushed to engines; null: the engine's")
    tpot_target_ms: float | None = Field(None, gt=0, description="TPOT target pushed to engines; null: the engine's")
    shed_max_waiting: int = Field(16, ge=1, description="admission queue per engine when demand exceeds the budget")
    forecast_alpha: float = Field(0.5, gt=0, le=1, description="Holt level smoothing")
    forecast_beta: float = Field(0.3, gt=0, le=1, description="Holt trend smoothing")
    forecast_phi: float = Field(0.98, gt=0, le=1, description="Holt trend damping per interval")

    @model_validator(mode="after")
    def _bounds_in_order(self) -> ControllerConfig:
        if self.min_decode_sms is not None and self.max_decode_sms is not None \
                and self.min_decode_sms > self.max_decode_sms:
            raise ValueError(f"min_decode_sms ({self.min_decode_sms}) must be <= max_decode_sms ({self.max_decode_sms})")
        if self.max_engines is not None and self.max_engines < self.min_engines:
            raise ValueError(f"max_engines ({self.max_engines}) must be >= min_engines ({self.min_engines})")
        return self
