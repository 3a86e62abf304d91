"""Prefill and decode workers as Ray actors: a `WorkerLauncher` for the engine inside a Serve replica.

Each worker actor runs `run_worker(spec)` in a long-running method call (the actor is threaded, so
`alive`-style calls still answer) and lands on the replica's node: in the replica's placement group
bundle when there is one (bundle 1 holds the engine's GPU), else pinned to the replica's node, since the
worker connects to the engine front's Unix socket and maps its shared memory.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from bullet_ray.engine.launcher import WorkerHandle, WorkerLauncher, WorkerRole, WorkerSpec

logger = logging.getLogger(__name__)


@ray.remote(max_concurrency=2)  # type: ignore[call-overload]
class WorkerActor:
    """Hosts one engine worker (prefill, decode or hybrid)."""

    def warm(self) -> None:
        """Import the worker code (torch) ahead of `run`; the engine starts both actors' imports at once."""
        import bullet_ray.engine.worker  # noqa: F401

    def run(self, spec: WorkerSpec) -> None:
        from bullet_ray.engine.worker import run_worker

        run_worker(spec)

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid(),
                                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible)) if visible.isdigit() else \
                pynvml.nvmlDeviceGetHandleByUUID(visible)
            info["gpu_uuid"] = pynvml.nvmlDeviceGetUUID(handle)
        except Exception:  # no GPU or no NVML: nothing to report
            pass
        return info


class _ActorHandle(WorkerHandle):
    def __init__(self, actor: Any, run_ref: Any) -> None:
        self.actor = actor
        self.run_ref = run_ref
        # completes when `run` returns or the actor dies; reading it costs ~1 us where `ray.wait(timeout=0)`
        # costs ~0.1-0.3 ms, and the engine checks its workers on every request it admits
        self._run_finished = run_ref.future()

    def is_alive(self) -> bool:
        return not self._run_finished.done()

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def join(self, timeout_s: float) -> None:
        ray.wait([self.run_ref], timeout=timeout_s)


class RayActorLauncher(WorkerLauncher):
    """Starts workers as Ray actors beside the calling Serve replica."""

    def __init__(self, accelerator: str | None, num_cpus: float = 1.0, bundle_index: int = 1,
                 env: dict[str, str] | None = None) -> None:
        self.accelerator = accelerator
        self.env = dict(env or {})  # e.g. the MPS daemon's pipe folder
        self.num_cpus = num_cpus
        self.bundle_index = bundle_index
        self.actors: dict[str, Any] = {}

    def _options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.env:
            options["runtime_env"] = {"env_vars": self.env}
        if self.accelerator == "GPU":
            options["num_gpus"] = 0.5
        elif self.accelerator:
            options["resources"] = {self.accelerator: 0.5}
        pg = get_current_placement_group()
        if pg is not None and self.bundle_index < pg.bundle_count:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=self.bundle_index)
        else:
            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False)
        return options

    def prepare(self, roles: list[WorkerRole]) -> None:
        """Create every worker actor now and let each import torch: the second worker's process is up and
        warm by the time the first one has loaded the model (shorter start-up and recovery)."""
        for role in roles:
            if role not in self.actors:
                actor = WorkerActor.options(name=None, **self._options()).remote()  # type: ignore[attr-defined]
                actor.warm.remote()
                self.actors[role] = actor

    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        actor = self.actors.get(spec.role)
        if actor is None:
            actor = WorkerActor.options(name=None, **self._options()).remote()  # type: ignore[attr-defined]
            self.actors[spec.role] = actor
        return _ActorHandle(actor, actor.run.remote(spec))

    def close(self) -> None:
        for actor in self.actors.values():  # prepared but never launched (start-up failed), or still up
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def describe(self) -> dict[str, dict[str, Any]]:
        """Where each worker runs (node, GPU UUID); used to check the pair shares one GPU."""
        return {role: ray.get(actor.describe.remote()) for role, actor in self.actors.items()}
