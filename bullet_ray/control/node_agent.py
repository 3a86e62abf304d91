"""The node agent: one detached Ray actor per node (started by the cluster controller).

- **MPS**: makes sure the node's MPS daemon runs when the application's workers are MPS clients
  (`ensure_mps`; engine replicas also start it on their own, whichever comes first) and stops it on
  request (`stop_mps`: only when no engine uses it).
- **Telemetry**: every `period_s`, NVML per GPU (utilisation, memory used, power, per-process memory)
  as bullet_node_* metrics; on a node without GPUs NVML reports nothing and only the node's accelerator
  resources (a fake GPU resource in CPU tests) and the MPS state are reported.
- **Relay**: `relay(app, decision)` hands a controller decision to the engine replicas on this node.
  Serve cannot address one replica, so the agent broadcasts the decision marked with its node id and
  replicas on other nodes ignore it (bullet_ray.control.apply).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from bullet_ray.gpu import nvml

logger = logging.getLogger(__name__)

NAMESPACE = "bullet_ray"


def agent_name(node_id: str) -> str:
    return f"bullet_node_agent:{node_id}"


class NodeAgent:
    """Ray actor class (see the module docstring); `start_node_agents` places one per node."""

    def __init__(self, node_id: str, accelerator: str | None = None, period_s: float = 5.0) -> None:
        from bullet_ray.metrics import NodeMetrics

        self.node_id = node_id
        self.accelerator = accelerator
        self.metrics = NodeMetrics(node_id[:12])
        self.mps_name: str | None = None
        self.num_relays = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), name="bullet-node-telemetry",
                                        daemon=True)
        self._thread.start()

    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.telemetry()
            except Exception:  # noqa: BLE001 - telemetry must not kill the agent
                logger.exception("telemetry failed")

    def telemetry(self) -> dict[str, Any]:
        """Per GPU NVML readings (empty without GPUs), this node's accelerator resources and MPS state."""
        gpus = []
        for i in range(nvml.device_count()):
            snap = nvml.snapshot(i)
            snap["power_watts"] = nvml.power_watts(i)
            gpu = str(snap.get("uuid") or i)
            if snap.get("gpu_util_percent") is not None:
                self.metrics.util.set(snap["gpu_util_percent"] / 100, tags={"gpu": gpu})
            if snap.get("memory_used_bytes") is not None:
                self.metrics.memory.set(snap["memory_used_bytes"], tags={"gpu": gpu})
            if snap["power_watts"] is not None:
                self.metrics.power.set(snap["power_watts"], tags={"gpu": gpu})
            gpus.append(snap)
        mps_running = self._mps_running()
        self.metrics.mps.set(1.0 if mps_running else 0.0)
        resources: dict[str, float] = next((n.get("Resources", {}) for n in ray.nodes()
                                            if n["NodeID"] == self.node_id), {})
        return {"node_id": self.node_id, "gpus": gpus, "mps_running": mps_running, "num_relays": self.num_relays,
                "accelerators": resources.get(self.accelerator, 0.0) if self.accelerator else 0.0}

    def _mps_running(self) -> bool:
        if self.mps_name is None:
            return False
        from bullet_ray.gpu.mps import MpsDaemon

        return MpsDaemon(self.mps_name).status().is_running

    def ensure_mps(self, mps_name: str) -> bool:
        """Start the node's MPS daemon `mps_name` unless it runs; True when it runs (False on a node
        without the NVIDIA driver: the agent logs why)."""
        from bullet_ray.gpu.mps import MpsDaemon, MpsError

        self.mps_name = mps_name
        try:
            return MpsDaemon(mps_name).start().is_running
        except MpsError as e:
            logger.warning("cannot start MPS daemon %s on node %s: %s", mps_name, self.node_id, e)
            return False

    def stop_mps(self) -> bool:
        """Stop the node's MPS daemon (call after the engines on this node are gone)."""
        if self.mps_name is None:
            return True
        from bullet_ray.gpu.mps import MpsDaemon

        return MpsDaemon(self.mps_name).stop()

    def relay(self, app_name: str, decision: dict[str, Any], timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Apply `decision` to this node's engine replicas of `app_name`; their answers (what is in force)."""
        from ray import serve

        handle = serve.get_deployment_handle("BulletEngine", app_name)
        answers = handle.broadcast("apply_policy", {**decision, "node_id": self.node_id}).results(
            timeout_s=timeout_s, return_exceptions=True)
        self.num_relays += 1
        out = []
        for a in answers:
            if isinstance(a, Exception):  # one replica starting or dying must not hold back the others
                logger.warning("a replica of %s did not take decision %s: %s", app_name, decision.get("seq"), a)
            elif not a.get("skipped"):
                out.append(a)
        return out

    def stop(self) -> None:
        self._stop.set()


def start_node_agents(accelerator: str | None) -> dict[str, Any]:
    """One agent per alive node (found or started): {node_id: actor handle}."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    agents = {}
    remote_cls = ray.remote(NodeAgent)
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        agents[node_id] = remote_cls.options(  # type: ignore[attr-defined]
            name=agent_name(node_id), namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
            max_restarts=-1, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, accelerator)
    return agents
