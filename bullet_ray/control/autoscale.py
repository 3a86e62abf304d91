"""Engine replica count through Ray Serve's autoscaler: a custom autoscaling policy that follows the controller.

The cluster controller writes the replica count it decided (ahead of the forecast load, within the GPU
budget) to Ray's internal key-value store; `follow_controller` is the engine deployment's
`autoscaling_config.policy`, run by Serve's controller every autoscaling tick, and returns that count.
Serve then applies its own bounds (min/max_replicas) and delays (`upscale_delay_s` 0 by default here:
the forecast already looked ahead). Before the controller's first decision the policy holds the current
target. The store is the same one that keeps the controller's state across restarts (and the node agents'
`kv_*(..., owner="node_agent")`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

KV_NAMESPACE = "bullet_ray"
POLICY_PATH = "bullet_ray.control.autoscale:follow_controller"


def actor_id() -> str | None:
    """The calling actor's id, the same across Ray's restarts of it (what persisted state is keyed with, so a
    restart takes it back and another actor does not); None outside an actor."""
    import ray

    return ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None


def kv_key(name: str, what: str, owner: str = "controller") -> bytes:
    """The key of `what` persisted by `owner` `name` ("controller", an application; "node_agent", a node id)."""
    return f"{owner}/{name}/{what}".encode()


def kv_put(name: str, what: str, value: Any, owner: str = "controller") -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(kv_key(name, what, owner), json.dumps(value).encode(), overwrite=True, namespace=KV_NAMESPACE)


def kv_get(name: str, what: str, owner: str = "controller") -> Any:
    from ray.experimental.internal_kv import _internal_kv_get

    raw = _internal_kv_get(kv_key(name, what, owner), namespace=KV_NAMESPACE)
    return None if raw is None else json.loads(raw)


def kv_names(owner: str) -> list[str]:
    """The names `owner` has persisted anything under (the middle part of its keys)."""
    from ray.experimental.internal_kv import _internal_kv_list

    prefix = f"{owner}/".encode()
    keys = _internal_kv_list(prefix, namespace=KV_NAMESPACE)
    return sorted({key[len(prefix):].decode().rsplit("/", 1)[0] for key in keys})


def kv_delete(name: str, what: str, owner: str = "controller") -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(kv_key(name, what, owner), namespace=KV_NAMESPACE)


def follow_controller(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve custom autoscaling policy (ctx: ray.serve.config.AutoscalingContext)."""
    try:
        wanted = kv_get(ctx.app_name, "num_replicas")
    except Exception as e:  # noqa: BLE001 - the store unreachable: hold, never scale on an error
        logger.warning("cannot read the controller's replica count: %s", e)
        wanted = None
    if wanted is None:
        return ctx.target_num_replicas, dict(ctx.policy_state)
    n = min(max(int(wanted), ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
    return n, {**ctx.policy_state, "controller_num_replicas": int(wanted)}


def autoscaling_config(min_engines: int, max_engines: int, initial: int) -> dict[str, Any]:
    """The engine deployment's autoscaling_config when a controller runs."""
    return {"min_replicas": min_engines, "max_replicas": max(max_engines, min_engines),
            "initial_replicas": min(max(initial, min_engines), max(max_engines, min_engines)),
            "upscale_delay_s": 0.0, "downscale_delay_s": 0.0, "look_back_period_s": 2.0,
            "policy": {"policy_function": POLICY_PATH}}
