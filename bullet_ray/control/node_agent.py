"""The node agent: one detached Ray actor per node (started by the cluster controller), shared by every application.

- **MPS**: makes sure the node's MPS daemon runs when the application's workers are MPS clients
  (`ensure_mps`; engine replicas also start it on their own, whichever comes first) and stops it on
  request (`stop_mps`: call it only when no engine uses it).
- **Leaving**: it learns the applications it serves from `relay` and `ensure_mps` (each call restarts the
  absence clock). Once every one of them has been absent from Serve for `app_gone_s` (an unbroken run of
  answers that name none of them: bullet_ray.control.serve_apps), it is leaving: from then on `relay` and
  `ensure_mps` raise `AgentLeavingError` (decided under the lock they take, so a call either came first and
  keeps it, or is refused), it stops each MPS daemon it ensured whose MPS servers have no client left
  (`stop_unused_daemon`, asking each server's clients; one that cannot tell is kept), deletes its persisted
  state, then kills itself. A controller whose call failed finds or starts the node's agent again at its next
  push.
- **Restarts**: the applications it serves and the MPS daemons it ensured are persisted in Ray's internal KV
  (`node_agent/<node id>/state`, with its actor id) whenever they change. Ray restarts a dead agent
  (max_restarts=-1, same actor id): the new instance takes them back in its constructor, so it keeps watching
  the same applications (the absence clock starts again) and stops the daemons it ensured when they go. State
  of another actor (an agent started again after one left or was killed) is not taken; state it cannot read
  (another format version, corrupt, or a KV call that fails) is logged and it starts fresh, knowing what its
  controllers' next calls tell it. A failed write is logged and tried again at the next call. The KV calls have
  no timeout of their own (Ray's internal KV waits for its GCS, as the controller's calls do). The key of a
  node that left the cluster without its agent leaving is deleted when a controller next starts the agents
  (`forget_departed_nodes`).
- **Asking Serve**: at most every `APPS_CHECK_S` (30 s, its own clock, not every telemetry period), with the
  lookup's timeout (serve_apps.LOOKUP_TIMEOUT_S: no answer is unknown).
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
import time
from collections.abc import Callable
from typing import Any

import ray

from bullet_ray.control import autoscale
from bullet_ray.control.autoscale import actor_id as _actor_id  # (tests replace it here)
from bullet_ray.control.serve_apps import APP_GONE_S, AppWatch, serve_app_names
from bullet_ray.gpu import nvml
from bullet_ray.gpu.mps import MpsDaemon, MpsError

logger = logging.getLogger(__name__)

NAMESPACE = "bullet_ray"
APPS_CHECK_S = 30.0  # the agent asks Serve which applications exist at most this often (every agent of the cluster asks)
STATE_VERSION = 1  # the format of the persisted state; a restarted agent starts fresh from any other
KV_OWNER = "node_agent"  # its persisted state: autoscale.kv_*(node_id, "state", owner=KV_OWNER)


class AgentLeavingError(RuntimeError):
    """The node agent is leaving (its applications are gone): find or start the node's agent again."""


def agent_name(node_id: str) -> str:
    return f"bullet_node_agent:{node_id}"


def stop_unused_daemon(daemon: MpsDaemon) -> bool:
    """Stop `daemon` unless a client may still use it; True when it is not running afterwards.

    Every MPS client connects through an MPS server, so a daemon that runs no server has no client. A server
    outlives its clients: each one's clients are asked (`get_client_list`), and the daemon is kept when any
    server has one or cannot tell (stop it with `deploy/mps/stop.sh NAME` once its clients are known gone);
    `quit` ends idle servers with the daemon."""
    status = daemon.status()
    if not status.is_running:
        return True
    clients = {pid: daemon.client_pids(pid) for pid in status.server_pids}
    in_use = {pid: c for pid, c in clients.items() if c is None or c}
    if in_use:
        logger.warning("MPS daemon %s keeps running: clients of its servers (None: unknown) %s", daemon.name, in_use)
        return False
    return daemon.stop()


class NodeAgent:
    """Ray actor class (see the module docstring); `start_node_agents` places one per node.

    `app_gone_s`: how long every application it served must be absent before it leaves; None: APP_GONE_S,
    or three telemetry periods if longer (tests pass a short one). `apps_check_s`: the least time between two
    questions to Serve (tests pass a short one)."""

    def __init__(self, node_id: str, accelerator: str | None = None, period_s: float = 5.0,
                 app_gone_s: float | None = None, run_loop: bool = True, apps_check_s: float = APPS_CHECK_S) -> None:
        from bullet_ray.metrics import NodeMetrics

        self.node_id = node_id
        self.accelerator = accelerator
        self.metrics = NodeMetrics(node_id[:12])
        self.mps_names: set[str] = set()  # the MPS daemons it ensured
        self.num_relays = 0
        self.apps = AppWatch(max(APP_GONE_S, 3 * period_s) if app_gone_s is None else app_gone_s)
        self._lock = threading.Lock()  # the applications, daemons and leaving: the loop reads what calls add
        self._is_leaving = False  # every served application is gone: it refuses calls, stops its daemons, exits
        self.apps_check_s = apps_check_s
        self._next_apps_check_s = 0.0  # monotonic time of its next question to Serve (its own clock)
        self.actor_id = _actor_id()  # the same across Ray's restarts; None outside an actor: nothing persisted
        self._persisted: dict[str, Any] | None = None  # the state last written to the KV (under the lock)
        self.num_restores = 0  # 1: this instance took back the state a previous instance of the actor persisted
        self._restore()
        self._stop = threading.Event()
        if run_loop:
            threading.Thread(target=self._loop, args=(period_s,), name="bullet-node-telemetry", daemon=True).start()

    # persisted state -------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "actor_id": self.actor_id, "app_names": sorted(self.apps.app_names),
                "mps_names": sorted(self.mps_names)}

    def _restore(self) -> None:
        """Take back the applications and daemons a previous instance of this actor persisted (Ray restarted it:
        the same actor id). Nothing outside an actor; state of another actor is not taken; state it cannot read
        starts it fresh, and says so."""
        if self.actor_id is None:
            return
        try:
            saved = autoscale.kv_get(self.node_id, "state", owner=KV_OWNER)
            if saved is None:
                return
            if saved["version"] != STATE_VERSION:
                raise ValueError(f"format version {saved['version']!r}, this code reads {STATE_VERSION}")
            if saved["actor_id"] != self.actor_id:  # the agent's name was free: this is a new actor, not a restart
                logger.info("node agent %s: the persisted state is another actor's (%s); it starts fresh",
                            self.node_id[:12], saved["actor_id"])
                return
            app_names, mps_names = saved["app_names"], saved["mps_names"]
            if not all(isinstance(names, list) and all(isinstance(n, str) for n in names)
                       for names in (app_names, mps_names)):
                raise TypeError(f"names that are not lists of strings: {app_names!r}, {mps_names!r}")
            for name in mps_names:
                MpsDaemon(name)  # ConfigError (a ValueError) on a name this code rejects
        except Exception as e:  # noqa: BLE001 - unreadable state (or no KV) must not keep the agent from starting
            logger.warning("node agent %s cannot read its persisted state (%s: %s); it starts fresh",
                           self.node_id[:12], type(e).__name__, e)
            return
        self.apps.app_names.update(app_names)
        self.mps_names.update(mps_names)
        self._persisted = self._state()
        self.num_restores = 1
        logger.info("node agent %s restored: applications %s, MPS daemons %s", self.node_id[:12],
                    sorted(self.apps.app_names), sorted(self.mps_names))

    def _persist(self) -> None:
        """Write the applications and daemons when they changed since the last write (caller holds the lock, so
        writes keep the order of the changes). A failed write is logged and tried again at the next call: the
        call itself goes on (the state in memory is right)."""
        state = self._state()
        if self.actor_id is None or state == self._persisted:
            return
        try:
            autoscale.kv_put(self.node_id, "state", state, owner=KV_OWNER)
        except Exception as e:  # noqa: BLE001 - the KV not answering must not fail a relay
            logger.warning("node agent %s cannot persist its state: %s", self.node_id[:12], e)
            return
        self._persisted = state

    def _forget(self) -> None:
        """Delete the persisted state (leaving); a failure is logged (the next agent on this node is another actor:
        it does not take the stale state)."""
        if self.actor_id is None:
            return
        try:
            autoscale.kv_delete(self.node_id, "state", owner=KV_OWNER)
        except Exception as e:  # noqa: BLE001 - leaving is final
            logger.warning("node agent %s cannot delete its persisted state: %s", self.node_id[:12], e)

    # the loop ---------------------------------------------------------------------------------------
    def _loop(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self.telemetry()
            except Exception:  # noqa: BLE001 - telemetry must not kill the agent
                logger.exception("telemetry failed")
            try:
                if self.check_apps(time.monotonic()):
                    return
            except Exception:  # noqa: BLE001 - a failed check must not kill the agent either
                logger.exception("the check of the served applications failed")

    def check_apps(self, now_s: float) -> bool:
        """Ask Serve which applications exist (`watch_apps`) unless it asked less than `apps_check_s` ago: the
        telemetry period is shorter, and every node's agent asks the one Serve controller. True: it left."""
        if now_s < self._next_apps_check_s:
            return False
        self._next_apps_check_s = now_s + self.apps_check_s
        return self.watch_apps(serve_app_names(), time.monotonic())

    def watch_apps(self, names: frozenset[str] | None, now_s: float) -> bool:
        """Take one answer of `serve_app_names()`; once every served application has been gone `app_gone_s`,
        stop the unused MPS daemons it ensured, delete its persisted state (after the daemons: an instance Ray
        restarts meanwhile still knows them), end the loop and kill this actor (True). The decision is taken
        under the lock `relay` and `ensure_mps` take: one that came earlier restarted the absence clock (no
        leaving), a later one is refused, so no application is added between the decision and the stopping of
        a daemon."""
        with self._lock:
            if not self.apps.observe(names, now_s):
                return False
            self._is_leaving = True
            mps_names = sorted(self.mps_names)
        logger.info("node agent %s: the applications %s are gone; it stops its unused MPS daemons %s and exits",
                    self.node_id[:12], sorted(self.apps.app_names), mps_names)
        try:
            for name in mps_names:
                try:
                    stop_unused_daemon(MpsDaemon(name))
                except Exception as e:  # noqa: BLE001 - an MpsError, an OSError of the control binary ...
                    logger.warning("cannot stop MPS daemon %s: %s", name, e)
        finally:  # leaving is final: alive and refusing every call, it would be found by name for good
            self._stop.set()
            self._forget()
            self._exit()
        return True

    def _exit(self) -> None:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

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
        with self._lock:
            mps_names = sorted(self.mps_names)
        return any(MpsDaemon(name).status().is_running for name in mps_names)

    def _serve(self, app_name: str) -> None:
        """Record a call for `app_name` (caller holds the lock, and persists); AgentLeavingError once it is leaving."""
        if self._is_leaving:
            raise AgentLeavingError(f"node agent {self.node_id[:12]} is leaving (its applications are gone); "
                                    f"find or start the node's agent again")
        self.apps.add([app_name])

    def ensure_mps(self, app_name: str, mps_name: str) -> bool:
        """Start the node's MPS daemon `mps_name` for application `app_name` unless it runs; True when it runs
        (False on a node without the NVIDIA driver: the agent logs why). AgentLeavingError once it is leaving
        (it may be about to stop that daemon); ConfigError for a bad `mps_name` (it is not recorded)."""
        daemon = MpsDaemon(mps_name)
        with self._lock:
            self._serve(app_name)
            self.mps_names.add(mps_name)
            self._persist()
        try:
            return daemon.start().is_running
        except MpsError as e:
            logger.warning("cannot start MPS daemon %s on node %s: %s", mps_name, self.node_id, e)
            return False

    def stop_mps(self) -> bool:
        """Stop the MPS daemons it ensured, whatever uses them (call after the engines on this node are gone)."""
        with self._lock:
            mps_names = sorted(self.mps_names)
        return all([MpsDaemon(name).stop() for name in mps_names])

    def relay(self, app_name: str, decision: dict[str, Any], timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Apply `decision` to this node's engine replicas of `app_name`; their answers (what is in force).
        AgentLeavingError once it is leaving."""
        from ray import serve

        with self._lock:
            self._serve(app_name)
            self._persist()

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
    """One agent per alive node (found or started): {node_id: actor handle}. The persisted state of agents on
    nodes that are gone (a node id is never reused, so no agent would read or delete it) is deleted."""
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
    forget_departed_nodes()
    return agents


def _alive_node_ids() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def forget_departed_nodes(alive_node_ids: Callable[[], set[str]] = _alive_node_ids) -> list[str]:
    """Delete the persisted state of agents whose node is no longer alive; the node ids deleted. The keys are
    listed before the nodes are asked: a key exists only once its node has registered, so a node that joins
    meanwhile (another application's controller starting its agent, which writes its state) is among the alive.
    A failure is logged and deletes nothing more (the next start tries again)."""
    try:
        names = autoscale.kv_names(KV_OWNER)
        alive = alive_node_ids()
        departed = [name for name in names if name not in alive]
        for node_id in departed:
            autoscale.kv_delete(node_id, "state", owner=KV_OWNER)
    except Exception as e:  # noqa: BLE001 - housekeeping must not keep the agents from starting
        logger.warning("cannot delete the persisted state of departed nodes' agents: %s", e)
        return []
    return departed
