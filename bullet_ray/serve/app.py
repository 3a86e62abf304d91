"""`build_app`: the application builder `serve run deploy/<file>.yaml` calls with the YAML's args."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from bullet_ray.serve.config import BulletAppConfig
from bullet_ray.serve.engine_deployment import EngineReplica
from bullet_ray.serve.ingress import Ingress

INGRESS_EXTRA_GRACE_S = 5.0


def build_app(args: dict[str, Any] | None = None, engine_factory: Any = None) -> Application:
    """Ingress + one engine replica per GPU (num_engines), or with `colocate_ingress` one deployment whose
    replicas are both (BulletEngine: the ingress routes over an engine in the same process). Deploys nothing; with a `controller:` section it
    starts (or finds) the application's cluster controller, whose replica count Serve's autoscaler follows.

    `engine_factory(app_config) -> EngineClient` replaces the real engine (tests use a mock engine).
    """
    config = BulletAppConfig(**(args or {}))
    options: dict[str, Any] = {
        "num_replicas": config.num_engines,
        "max_ongoing_requests": config.max_ongoing_requests,
        "max_queued_requests": config.max_ongoing_requests,
        "ray_actor_options": {"num_cpus": config.engine_num_cpus},
        "request_router_config": {"request_router_class": "bullet_ray.serve.router:PredictedTTFTRouter",
                                  "request_routing_stats_period_s": 1.0},
        "health_check_period_s": config.health_check_period_s,
        "health_check_timeout_s": config.health_check_timeout_s,
        # running requests may finish for drain_grace_s; Serve then kills the replica (the engine's watchdog
        # removes its shared memory and workers if the destructor could not run)
        "graceful_shutdown_timeout_s": config.drain_grace_s,
        "graceful_shutdown_wait_loop_s": 0.5,
        # Serve's own refusal when its queue for the engines is full: a 429 with Retry-After like ours (the
        # ingress turns it into an OpenAI body; where it escapes, Serve answers with these)
        "backpressure_config": {"status_code": 429, "retry_after_s": config.retry_after_s},
    }
    accelerator = config.accelerator
    if accelerator is not None and config.worker_launcher == "ray":
        # bundle 0: the engine front (CPU only); bundle 1: the engine's GPU for its two worker actors
        workers: dict[str, float] = {"CPU": 2 * config.worker_num_cpus, accelerator: 1.0}
        options["placement_group_bundles"] = [{"CPU": max(config.engine_num_cpus, 0.01)}, workers]
        options["placement_group_strategy"] = "STRICT_PACK"
    if config.controller is not None:  # replicas follow the controller; it starts (or is found) now
        from bullet_ray.control.controller import controller_options

        options.update(controller_options(config))
    dumped = config.model_dump()
    if config.colocate_ingress:  # one deployment: the ingress routes over an engine in the same process
        colocated = Ingress.options(name="BulletEngine", **options)  # type: ignore[attr-defined]
        return colocated.bind(None, dumped, engine_factory)
    engine = serve.deployment(EngineReplica, name="BulletEngine").options(**options)  # type: ignore[attr-defined]
    # the ingress outlives the engines' drain by a little, so it can stream their last (error) events
    ingress = Ingress.options(name="BulletIngress", num_replicas=config.num_ingress_replicas,  # type: ignore[attr-defined]
                              ray_actor_options={"num_cpus": config.ingress_num_cpus},
                              graceful_shutdown_timeout_s=config.drain_grace_s + INGRESS_EXTRA_GRACE_S,
                              graceful_shutdown_wait_loop_s=0.5)
    return ingress.bind(
        engine.bind(dumped, engine_factory), dumped)
