"""The cluster controller: one detached, named Ray actor per application (`start_controller`).

Every `interval_s` it reads the metrics (bullet_ray.control.readings: Prometheus when `prometheus_url`
is set, else every node's exporter), updates the load forecast (bullet_ray.control.forecast), decides
(bullet_ray.control.decide, pure), then:
- writes the replica count to Ray's internal KV, where the engine deployment's custom autoscaling policy
  reads it (bullet_ray.control.autoscale);
- pushes each engine its split bounds, SLO targets and admission through the node agent of the engine's
  node (`NodeAgent.relay`), or straight to the deployment when no agent answers;
- logs the decision with its inputs, exports it as bullet_controller_* metrics and persists its state
  (decision counter, scale-down streak, forecaster, operator overrides, last decision, the deployed
  settings) in the internal KV, so a restarted controller (Ray restarts it: max_restarts=-1) continues where
  it was.
A redeploy of the application finds the running controller and hands it the new settings (`redeploy`), without
waiting on a decision in progress; a found controller that cannot take them is replaced (`start_controller`).
It stops itself when its application has been gone for `APP_GONE_S` (`serve.delete`, `serve.shutdown`; asked
through bullet_ray.control.serve_apps, which drops Serve's stale client; nothing happens while Serve cannot tell).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from bullet_ray.control import autoscale
from bullet_ray.control.autoscale import actor_id as _actor_id  # (tests replace it here)
from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.decide import ControllerInputs, ControllerState, Decision, decide
from bullet_ray.control.forecast import LoadForecaster
from bullet_ray.control.readings import ClusterReading, NodeExporterReader, PrometheusReader
from bullet_ray.control.serve_apps import APP_GONE_S, AppWatch, serve_app_names

if TYPE_CHECKING:
    from bullet_ray.serve.config import BulletAppConfig

logger = logging.getLogger(__name__)

NAMESPACE = "bullet_ray"
# APP_GONE_S (serve_apps): the application missing this long (never deployed, or deleted) -> the controller exits
REDEPLOY_WAIT_S = 5.0  # how long a build waits for a found controller to take its settings (a tick may hold it longer)
GONE_WAIT_S = 10.0  # how long start_controller waits for a killed controller's name to be free again


def controller_name(app_name: str) -> str:
    return f"bullet_controller:{app_name}"


@dataclass(frozen=True)
class AppSpec:
    """What the controller takes from the application's args besides its `controller:` section."""

    model_name: str  # selects the application's series in the metrics
    accelerator: str | None  # the Ray resource one engine occupies (a GPU); None on CPU
    num_engines: int  # the configured engine replicas: the first replica count and the budget's floor
    cpus_per_engine: float = 1.0  # CPUs Ray reserves for one engine replica (its front and worker actors)
    mps_name: str | None = None  # the MPS daemon the engines' workers are clients of, on every node; None: no MPS
    ingress_cpus: float = 0.0  # CPUs the ingress deployment reserves in all (replicas x CPUs); 0 when colocated

    @classmethod
    def of(cls, app: BulletAppConfig) -> AppSpec:
        workers = 2 * app.worker_num_cpus if app.worker_launcher == "ray" else 0.0  # else child processes
        return cls(app.model_name, app.accelerator, app.num_engines, app.engine_num_cpus + workers,
                   app.mps_name if app.uses_mps else None, app.ingress_cpus)


def engine_budget(cfg: ControllerConfig, spec: AppSpec, cluster: Mapping[str, float]) -> int:
    """The most engine replicas: `max_engines`, else as many as the cluster holds (`cluster`: Ray's
    cluster_resources()): one per `cpus_per_engine` of the CPUs the ingress replicas leave (`ingress_cpus`: they
    are placed too, so counting their CPUs promised engines that could not be; at least one CPU per engine: an
    engine that reserves none still computes) and, with an accelerator, at most one per unit of it (an 8-GPU node
    with 16 CPUs and 2 one-CPU ingress replicas holds 4 engines that reserve 3 CPUs each, not 8); never fewer than
    the configured `num_engines` or `min_engines`. On CPU it was the replica count of the moment, which only
    shrank."""
    if cfg.max_engines is not None:
        return cfg.max_engines
    free_cpus = max(0.0, cluster.get("CPU", 0.0) - spec.ingress_cpus)
    fits = int(free_cpus // max(1.0, spec.cpus_per_engine))
    if spec.accelerator is not None:
        fits = min(fits, int(cluster.get(spec.accelerator, 0.0)))
    return max(cfg.min_engines, spec.num_engines, fits)


class ClusterController:
    """Ray actor class (see the module docstring)."""

    def __init__(self, config: dict[str, Any], spec: AppSpec, run_loop: bool = True) -> None:
        from bullet_ray.metrics import ControllerMetrics

        self.base_config = ControllerConfig(**config)
        self.spec = spec
        self.app = self.base_config.app_name
        self.overrides: dict[str, Any] = {}
        self.state = ControllerState()
        self.last: Decision | None = None
        self.num_replicas = spec.num_engines
        self.num_restores = 0
        self.cfg = self.base_config
        self.forecaster = self._new_forecaster()
        self._restore()
        self.metrics = ControllerMetrics(self.app)
        self.log: collections.deque[dict[str, Any]] = collections.deque(maxlen=100)
        self.reader: PrometheusReader | NodeExporterReader = self._new_reader()
        self._agents: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._app_watch = AppWatch(APP_GONE_S, {self.app})  # read and changed under the lock
        self._is_leaving = False  # its application is gone: it forgets its state and exits; set under the lock
        self._last_redeploy_s: float | None = None  # when the last redeploy it took was issued (`redeploy`)
        if run_loop:
            threading.Thread(target=self._loop, name="bullet-controller", daemon=True).start()

    # state ------------------------------------------------------------------------------------------
    def _config_with(self, overrides: dict[str, Any]) -> ControllerConfig:
        """The base config (the YAML's) with `overrides` on top, validated as a whole (ValueError)."""
        return ControllerConfig(**{**self.base_config.model_dump(), **overrides})

    def _keep_valid(self, overrides: dict[str, Any], when: str) -> tuple[dict[str, Any], ControllerConfig]:
        """The overrides that still validate on the base config, and the config they make: all of them when they
        validate together (a floor dropped with a ceiling lowered below it validates only as a pair); else one at
        a time in the order of their names, each kept only if the config validates with it and the ones kept
        before it; each dropped one is logged with the reason (`when`: what is happening, for the log)."""
        try:
            return dict(overrides), self._config_with(dict(overrides))
        except ValueError:
            pass
        kept: dict[str, Any] = {}
        cfg = self.base_config
        for name in sorted(overrides):
            try:
                cfg = self._config_with({**kept, name: overrides[name]})
            except ValueError as e:
                logger.warning("controller %s drops its override %s=%r %s: %s", self.app, name, overrides[name],
                               when, e)
            else:
                kept[name] = overrides[name]
        return kept, cfg

    def _new_reader(self) -> PrometheusReader | NodeExporterReader:
        c = self.cfg
        return PrometheusReader(c.prometheus_url, self.spec.model_name, window_s=max(30.0, 3 * c.interval_s)) \
            if c.prometheus_url else NodeExporterReader(self.spec.model_name)

    def _new_forecaster(self) -> LoadForecaster:
        c = self.cfg
        return LoadForecaster(c.interval_s, c.horizon_s, c.forecast_alpha, c.forecast_beta, c.forecast_phi)

    def _restore(self) -> None:
        """Continue from the persisted state. State this code cannot read (persisted by another bullet_ray version:
        a field since removed or renamed) must not fail every start for good: the controller then starts fresh
        from its arguments, and says so."""
        saved = autoscale.kv_get(self.app, "state")
        if not saved:
            return
        started_with = (self.base_config, self.spec, self.cfg, self.num_replicas)
        try:
            self._restore_from(saved)
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            logger.warning("controller %s cannot read its persisted state (%s: %s); it starts fresh", self.app,
                           type(e).__name__, e)
            self.base_config, self.spec, self.cfg, self.num_replicas = started_with
            self.overrides, self.state, self.last, self.num_restores = {}, ControllerState(), None, 0
            self.forecaster = self._new_forecaster()

    def _restore_from(self, saved: dict[str, Any]) -> None:
        deployed = saved.get("deployed")
        if deployed and deployed["actor_id"] is not None and deployed["actor_id"] == _actor_id():
            # Ray restarted this actor with its first deploy's arguments: a redeploy since then handed it newer ones.
            # Settings this code rejects (saved by another bullet_ray version) must not fail every restart for good:
            # the constructor's arguments then stand.
            try:
                self.base_config, self.spec = ControllerConfig(**deployed["config"]), AppSpec(**deployed["spec"])
            except (ValueError, TypeError, KeyError) as e:
                logger.warning("controller %s cannot take its saved deployed settings (%s); it keeps the ones it was "
                               "started with", self.app, e)
            self.cfg = self.base_config
        # validated against this start's base config (a saved floor may sit above a new ceiling)
        self.overrides, self.cfg = self._keep_valid(saved.get("overrides", {}), "on a restore")
        self.forecaster = self._new_forecaster()
        self.forecaster.load_dict(saved["forecaster"])
        self.state = ControllerState(**saved["state"])
        self.last = Decision.from_dict(saved["last"]) if saved.get("last") else None
        self.num_replicas = saved.get("num_replicas", self.num_replicas)
        self.num_restores = saved.get("num_restores", 0) + 1
        logger.info("controller %s restored at decision %d", self.app, self.state.seq)

    def _persist(self) -> None:
        autoscale.kv_put(self.app, "state", {
            "overrides": self.overrides, "forecaster": self.forecaster.to_dict(),
            "state": dataclasses.asdict(self.state), "last": self.last.to_dict() if self.last else None,
            "num_replicas": self.num_replicas, "num_restores": self.num_restores,
            "deployed": {"actor_id": _actor_id(), "config": self.base_config.model_dump(),
                         "spec": dataclasses.asdict(self.spec)}})

    def _use(self, cfg: ControllerConfig, spec: AppSpec) -> None:
        """Settings in force from the next decision on: the reader rebuilt where what it reads changed, the
        forecaster's level and trend kept (its interval, horizon and factors are new), node agents found again
        (and the MPS daemon ensured on each) where the MPS daemon changed."""
        old_cfg, old_spec = self.cfg, self.spec
        self.cfg, self.spec = cfg, spec
        if (cfg.prometheus_url, cfg.interval_s, spec.model_name) \
                != (old_cfg.prometheus_url, old_cfg.interval_s, old_spec.model_name):
            self.reader = self._new_reader()
        kept = self.forecaster.to_dict()
        self.forecaster = self._new_forecaster()
        self.forecaster.load_dict(kept)
        if spec.mps_name != old_spec.mps_name:
            self._agents = {}

    # operator API -----------------------------------------------------------------------------------
    def update_config(self, changes: dict[str, Any]) -> dict[str, Any]:
        """Change settings at run time (e.g. {"max_decode_sms": 32}); validated, persisted, used from the next
        decision on. Returns the overrides in force."""
        with self._lock:
            merged = {**self.overrides, **changes}
            cfg = self._config_with(merged)
            self.overrides = merged
            self._use(cfg, self.spec)
            self._persist()
            return dict(self.overrides)

    def redeploy(self, config: dict[str, Any], spec: AppSpec, issued_s: float | None = None) -> bool:
        """A redeploy's settings: `start_controller` hands them to the controller it found (Ray does not rerun a
        found actor's constructor). The settings in force already: nothing changes, every state is kept (False).
        Else the new `controller:` section is the base config: an operator override of a field it changed is
        dropped (the later word wins), the others kept one at a time where they still validate (`_keep_valid`: one
        that conflicts with the new section does not take the others with it); used from the next decision on
        (`_use`), and persisted, so a restart by Ray keeps them (True). `issued_s`: when the build sent them (wall
        clock); two redeploys queued behind one decision take the lock in no set order, so one issued before the
        last one taken is ignored (False)."""
        base = ControllerConfig(**config)
        with self._lock:
            if self._is_leaving:  # start_controller replaces it
                raise RuntimeError(f"controller {self.app} is exiting: its application was gone")
            self._app_watch.absent_since_s = None  # the application is being deployed: its absence clock restarts
            if issued_s is not None:
                if self._last_redeploy_s is not None and issued_s < self._last_redeploy_s:
                    logger.info("controller %s ignores a redeploy issued before the last one it took", self.app)
                    return False
                self._last_redeploy_s = issued_s
            if base == self.base_config and spec == self.spec:
                return False
            changed = {k for k, v in base.model_dump().items() if getattr(self.base_config, k) != v}
            self.base_config = base
            kept, cfg = self._keep_valid({k: v for k, v in self.overrides.items() if k not in changed},
                                         "on a redeploy")
            dropped = {k: v for k, v in self.overrides.items() if k not in kept}
            self.overrides = kept
            self._use(cfg, spec)
            self._persist()
            logger.info("controller %s redeployed: changed %s, overrides dropped %s", self.app,
                        sorted(changed) or "the app spec", dropped)
            return True

    def status(self) -> dict[str, Any]:
        """A consistent view: under the decision lock (a tick sets num_replicas, pushes, then logs; read in
        between, the replica count was ahead of the log)."""
        with self._lock:
            return {"app": self.app, "seq": self.state.seq, "num_replicas": self.num_replicas,
                    "num_restores": self.num_restores, "config": self.cfg.model_dump(),
                    "overrides": dict(self.overrides),
                    "forecaster": self.forecaster.to_dict(), "last": self.last.to_dict() if self.last else None,
                    "log": list(self.log)[-10:]}

    def stop(self) -> None:
        self._stop.set()

    # the loop ---------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                names = serve_app_names()
                if self._leave_if_gone(names, time.monotonic()):
                    return
                if self._app_watch.is_present(names):  # absent or unknown: no decision
                    self.tick()
            except OSError as e:  # Prometheus or a node exporter not answering (yet): try again next interval
                logger.warning("controller %s cannot read metrics: %s", self.app, e)
            except Exception:  # noqa: BLE001 - a bad reading must not stop the controller
                logger.exception("controller tick failed")

    def _leave_if_gone(self, names: frozenset[str] | None, now_s: float) -> bool:
        """Take one answer of `serve_app_names()`; once the application has been gone `APP_GONE_S`, forget the
        persisted state and kill this actor (True). Under the decision lock, so a redeploy that arrives meanwhile
        (it restarts the absence clock) either comes first or finds it leaving and fails (start_controller then
        starts a new controller)."""
        with self._lock:
            if not self._app_watch.observe(names, now_s):
                return False
            self._is_leaving = True
            logger.info("application %s is gone: the controller forgets its state and exits", self.app)
            try:
                for what in ("state", "num_replicas"):
                    autoscale.kv_delete(self.app, what)
            finally:  # leaving is final: a failed delete must not leave it alive and refusing redeploys
                self._exit()
            return True

    def _exit(self) -> None:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def tick(self, reading: ClusterReading | None = None) -> dict[str, Any]:
        """One decision now (the loop calls it; tests may too). Returns its log record."""
        with self._lock:
            reading = reading or self.reader.read()
            if reading.is_baseline:  # a reader's first scrape measures nothing: a 0 req/s would seed the trend
                return {"baseline": True, "time_s": reading.time_s}
            self.forecaster.update(reading.load)
            inputs = ControllerInputs(reading.time_s, reading.engines, reading.load,
                                      self.forecaster.forecast(age_s=reading.age_s),
                                      self.num_replicas, engine_budget(self.cfg, self.spec, ray.cluster_resources()),
                                      reading.attainment)
            decision, self.state = decide(inputs, self.cfg, self.state)
            self.last = decision
            self.num_replicas = decision.num_replicas
            autoscale.kv_put(self.app, "num_replicas", decision.num_replicas)
            pushed = self._push(decision)
            self._persist()
            record = {"inputs": dataclasses.asdict(inputs), "decision": decision.to_dict(), "pushed": pushed}
            self.log.append(record)
            self._export(inputs, decision)
            logger.info("decision %d: %s replicas, %s; inputs: rate %.2f req/s (forecast %.2f), %d engines",
                        decision.seq, decision.num_replicas, "; ".join(decision.reasons), inputs.load.rate_rps,
                        inputs.forecast.rate_rps, len(inputs.engines))
            return record

    def _push(self, decision: Decision) -> list[dict[str, Any]]:
        """Decision to every engine: through the node agents, else one broadcast; answers of the engines. An agent
        that does not answer (dead, or left: node_agent) makes the next push find or start every node's agent."""
        from bullet_ray.control.node_agent import start_node_agents

        d = decision.to_dict()
        try:
            alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            if alive != set(self._agents):  # first push, or nodes came or went: find or start their agents
                new = set(alive) - set(self._agents)
                self._agents = start_node_agents(self.spec.accelerator)
                if self.spec.mps_name is not None:  # the engines' workers are MPS clients: every node runs the daemon
                    mps_name = self.spec.mps_name
                    ray.get([self._agents[n].ensure_mps.remote(self.app, mps_name) for n in new if n in self._agents],
                            timeout=60)
            refs = [agent.relay.remote(self.app, d) for agent in self._agents.values()]
            return [a for answers in ray.get(refs, timeout=30) for a in answers]
        except Exception as e:  # noqa: BLE001 - an agent down: push directly, find agents again next time
            # (a dead handle: an agent that left once its applications were gone, or one Ray could not restart)
            logger.warning("relay through node agents failed (%s); pushing directly", e)
            self._agents = {}
        try:
            from ray import serve

            handle = serve.get_deployment_handle("BulletEngine", self.app)
            return list(handle.broadcast("apply_policy", d).results(timeout_s=30))
        except Exception as e:  # noqa: BLE001
            logger.warning("push of decision %d failed: %s", decision.seq, e)
            self.metrics.push_failures.inc(1)
            return []

    def _export(self, inputs: ControllerInputs, d: Decision) -> None:
        m, fc, load = self.metrics, inputs.forecast, inputs.load
        m.decisions.inc(1, tags={"mode": d.mode})
        m.num_replicas.set(d.num_replicas)
        m.rate.set(load.rate_rps, tags={"kind": "measured"})
        m.rate.set(fc.rate_rps, tags={"kind": "forecast"})
        measured = load.rate_rps * ((load.mean_prompt_tokens or fc.mean_prompt_tokens)
                                    + (load.mean_output_tokens or fc.mean_output_tokens))
        m.demand.set(measured, tags={"kind": "measured"})
        m.demand.set(fc.tokens_per_s, tags={"kind": "forecast"})
        m.capacity.set(d.capacity_tokens_s)
        for phase, now, ahead in (("prompt", load.mean_prompt_tokens, fc.mean_prompt_tokens),
                                  ("output", load.mean_output_tokens, fc.mean_output_tokens)):
            if now is not None:
                m.mean_tokens.set(now, tags={"phase": phase, "kind": "measured"})
            m.mean_tokens.set(ahead, tags={"phase": phase, "kind": "forecast"})
        if inputs.attainment is not None:
            m.attainment.set(inputs.attainment)
        for e in (*d.engines, d.default):
            for bound, value in (("min", e.min_decode_sms), ("max", e.max_decode_sms)):
                if value is not None:
                    m.bound.set(value, tags={"engine": e.engine_id, "bound": bound})


def _find_or_create(config: ControllerConfig, spec: AppSpec) -> Any:
    """The application's named controller actor: the running one (its constructor is not run again), else a new one."""
    return ray.remote(ClusterController).options(  # type: ignore[attr-defined]
        name=controller_name(config.app_name), namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_concurrency=4,
    ).remote(config.model_dump(), spec)


def _wait_until_gone(app_name: str, timeout_s: float = GONE_WAIT_S) -> None:
    """Wait until the controller's name is free (ray.kill returns before the actor is gone), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(controller_name(app_name), namespace=NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)
    logger.warning("controller %s still registered %.0f s after it was killed", app_name, timeout_s)


def start_controller(config: ControllerConfig, spec: AppSpec) -> Any:
    """Find or start the application's controller (detached, restarted by Ray when it dies); one that was
    running already takes these settings (`ClusterController.redeploy`; the same ones change nothing).

    The build is not held up by a busy controller: a tick holds the decision lock across metrics reads and pushes,
    so when the redeploy has not run within `REDEPLOY_WAIT_S` it stays queued (the settings apply once the
    decision in progress ends) and this returns. A found controller that cannot take them (one of an older
    bullet_ray without `redeploy`, or one exiting because its application was gone: a Ray actor or task error,
    or AttributeError) is killed, its persisted state kept, and a fresh one started, once; a second failure
    raises."""
    for attempt in (1, 2):
        actor = _find_or_create(config, spec)
        try:
            ref = actor.redeploy.remote(config.model_dump(), spec, time.time())
            done, _ = ray.wait([ref], timeout=REDEPLOY_WAIT_S)
            if not done:
                logger.info("controller %s is deciding: the new settings apply once its decision in progress ends",
                            config.app_name)
                return actor
            ray.get(ref)
            return actor
        except (RayActorError, RayTaskError, AttributeError) as e:
            if attempt == 2:
                raise
            logger.warning("controller %s cannot take the new settings (%s: %s); it is replaced by a new one",
                           config.app_name, type(e).__name__, e)
            stop_controller(config.app_name, forget=False)
            _wait_until_gone(config.app_name)
    raise AssertionError("not reached")


def stop_controller(app_name: str, forget: bool = True) -> None:
    """Kill the application's controller; `forget` also drops its persisted state."""
    try:
        ray.kill(ray.get_actor(controller_name(app_name), namespace=NAMESPACE), no_restart=True)
    except ValueError:
        pass
    if forget:
        for what in ("state", "num_replicas"):
            autoscale.kv_delete(app_name, what)


def controller_options(app_config: BulletAppConfig) -> dict[str, Any]:
    """Engine deployment options when the app has a controller (`controller` set): an autoscaling_config
    following the controller instead of num_replicas, up to `engine_budget` (the cluster's resources when Ray
    runs here, else num_engines). Starts the controller when Ray runs here (the builder runs in `serve run`'s
    build task or the driver)."""
    cfg = app_config.controller
    if cfg is None:
        raise ValueError("controller_options needs an app config with a `controller:` section")
    spec = AppSpec.of(app_config)
    budget = engine_budget(cfg, spec, ray.cluster_resources() if ray.is_initialized() else {})
    if ray.is_initialized():
        start_controller(cfg, spec)
    return {"num_replicas": "auto",
            "autoscaling_config": autoscale.autoscaling_config(cfg.min_engines, budget, app_config.num_engines)}
