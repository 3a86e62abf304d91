"""The cluster controller's own logic without a Ray cluster: its engine budget and its decisions over time
(the internal KV replaced by a dict, the push to engines by a list, the cluster's resources by a dict)."""

from __future__ import annotations

import dataclasses

import pytest
import ray
from ray.exceptions import ActorDiedError, RayTaskError

from bullet_ray.control import autoscale
from bullet_ray.control import controller as controller_module
from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.controller import AppSpec, ClusterController, controller_options, engine_budget
from bullet_ray.control.forecast import LoadSample
from bullet_ray.control.readings import ClusterReading, NodeExporterReader, PrometheusReader
from bullet_ray.serve.config import BulletAppConfig


@pytest.fixture
def kv(monkeypatch) -> dict:
    store: dict = {}
    monkeypatch.setattr(autoscale, "kv_get", lambda app, what: store.get((app, what)))
    monkeypatch.setattr(autoscale, "kv_put", lambda app, what, value: store.__setitem__((app, what), value))
    monkeypatch.setattr(autoscale, "kv_delete", lambda app, what: store.pop((app, what), None))
    return store


@pytest.fixture
def cluster(monkeypatch) -> dict:
    """ray.cluster_resources() of a cluster that is not there; tests fill it."""
    resources: dict = {}
    monkeypatch.setattr(ray, "cluster_resources", lambda: dict(resources))
    return resources


def make_controller(config: dict, spec: AppSpec) -> ClusterController:
    controller = ClusterController(config, spec, run_loop=False)
    controller.pushed = []  # type: ignore[attr-defined]
    controller._push = lambda decision: controller.pushed.append(decision) or []  # type: ignore[method-assign]
    return controller


def reading(t: float, rate_rps: float) -> ClusterReading:
    return ClusterReading(t, LoadSample(rate_rps, 10.0, 10.0), None, ())


CPU = AppSpec("m", accelerator=None, num_engines=2, cpus_per_engine=3.0)


@pytest.mark.parametrize("config,spec,resources,budget", [
    ({"max_engines": 3}, CPU, {"CPU": 64.0}, 3),  # the operator's budget wins
    ({}, CPU, {"CPU": 8.0}, 2),  # 8 CPUs // 3 per engine = 2 (= num_engines)
    ({}, CPU, {"CPU": 16.0}, 5),  # 16 // 3
    ({}, CPU, {}, 2),  # Ray not running here: the configured replicas
    ({"min_engines": 4}, CPU, {"CPU": 8.0}, 4),
    ({}, AppSpec("m", None, 1, cpus_per_engine=0.0), {"CPU": 6.0}, 6),  # reserves none: one CPU each
    ({}, AppSpec("m", "GPU", 1), {"GPU": 8.0, "CPU": 128.0}, 8),  # one per GPU where the CPUs hold them
    ({}, AppSpec("m", "GPU", 1, cpus_per_engine=3.0), {"GPU": 8.0, "CPU": 16.0}, 5),  # 16 CPUs // 3 per engine
    ({}, AppSpec("m", "GPU", 3), {"GPU": 2.0}, 3),  # never below num_engines
])
def test_engine_budget(config, spec, resources, budget):
    assert engine_budget(ControllerConfig(**config), spec, resources) == budget


GPU_INGRESS = AppSpec("m", "GPU", 1, cpus_per_engine=3.0, ingress_cpus=2.0)  # 2 ingress replicas x 1 CPU
CPU_INGRESS = dataclasses.replace(CPU, ingress_cpus=2.0)


@pytest.mark.parametrize("config,spec,resources,budget", [
    ({}, GPU_INGRESS, {"GPU": 8.0, "CPU": 16.0}, 4),  # (16 - 2) // 3, not 16 // 3 = 5
    ({}, CPU_INGRESS, {"CPU": 16.0}, 4),  # the same on a CPU-only cluster
    ({}, CPU_INGRESS, {"CPU": 17.0}, 5),  # 15 // 3
    ({}, AppSpec("m", None, 1, cpus_per_engine=0.0, ingress_cpus=2.0), {"CPU": 6.0}, 4),  # one CPU each of 6 - 2
    ({"max_engines": 6}, CPU_INGRESS, {"CPU": 16.0}, 6),  # the operator's budget is taken as it is
    ({}, CPU_INGRESS, {"CPU": 1.0}, 2),  # the ingress takes more than there is: num_engines still
    ({"min_engines": 3}, CPU_INGRESS, {"CPU": 8.0}, 3),  # (8 - 2) // 3 = 2, under the floor
])
def test_engine_budget_leaves_the_ingress_cpus(config, spec, resources, budget):
    assert engine_budget(ControllerConfig(**config), spec, resources) == budget


def test_cpu_spec_counts_the_reserved_cpus():
    ray_workers = BulletAppConfig(engine_num_cpus=1, worker_num_cpus=1.5, controller={})
    processes = BulletAppConfig(engine_num_cpus=1, worker_num_cpus=1.5, worker_launcher="process", controller={})
    assert AppSpec.of(ray_workers).cpus_per_engine == 4.0 and AppSpec.of(ray_workers).accelerator is None
    assert AppSpec.of(processes).cpus_per_engine == 1.0


def test_spec_counts_the_ingress_cpus():
    """The ingress replicas' CPUs, from the same args build_app gives the ingress deployment; none when the
    routes run in the engine replicas."""
    assert AppSpec.of(BulletAppConfig(controller={})).ingress_cpus == 1.0  # one replica, Serve's default CPU
    separate = BulletAppConfig(num_ingress_replicas=2, ingress_num_cpus=1.5, controller={})
    assert AppSpec.of(separate).ingress_cpus == 3.0
    colocated = BulletAppConfig(num_ingress_replicas=2, colocate_ingress=True, controller={})
    assert AppSpec.of(colocated).ingress_cpus == 0.0


def test_serve_may_scale_a_cpu_app_past_its_configured_replicas(monkeypatch, cluster):
    cluster["CPU"] = 16.0
    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(controller_module, "start_controller", lambda cfg, spec: started.append(spec))
    app = BulletAppConfig(num_engines=2, controller={})  # 3 CPUs per engine by default (front + 2 workers)
    options = controller_options(app)
    assert options["autoscaling_config"]["max_replicas"] == 5  # (16 - 1 of the ingress) // 3
    assert options["autoscaling_config"]["initial_replicas"] == 2
    assert started == [AppSpec(app.model_name, None, 2, 3.0, None, ingress_cpus=1.0)]


def test_a_cpu_app_scales_down_and_up_again(kv, cluster):
    """On CPU without max_engines the budget was the replica count of the moment: once scaled down to one,
    demand for three engines held it at one (and shed). Now the cluster's 16 CPUs hold five engines."""
    cluster["CPU"] = 16.0
    config = {"engine_capacity_tokens_s": 100.0, "target_utilization": 1.0, "scale_down_after": 1, "horizon_s": 0.0}
    controller = make_controller(config, CPU)
    low = controller.tick(reading(1.0, 0.5))  # 10 tok/s: one engine
    high = controller.tick(reading(2.0, 15.0))  # 300 tok/s: three
    assert (low["decision"]["num_replicas"], low["inputs"]["max_engines"]) == (1, 5)
    decision = high["decision"]
    assert (decision["num_replicas"], high["inputs"]["max_engines"], decision["mode"]) == (3, 5, "queue")
    assert kv[(controller.app, "num_replicas")] == 3 and len(controller.pushed) == 2


# redeploy: a found controller takes the new `controller:` section -------------------------------------------
YAML = {"app_name": "app", "interval_s": 5.0, "engine_capacity_tokens_s": 100.0, "max_decode_sms": 96,
        "min_decode_sms": 8}
GPU = AppSpec("m", accelerator="GPU", num_engines=1)


def decided(controller: ClusterController, t: float) -> tuple:
    d = controller.tick(reading(t, 1.0))["decision"]["default"]
    return d["min_decode_sms"], d["max_decode_sms"]


def test_a_same_config_redeploy_changes_nothing(kv, cluster):
    controller = make_controller(YAML, GPU)
    decided(controller, 1.0)
    controller.update_config({"max_decode_sms": 48})
    reader, before = controller.reader, controller.status()
    assert controller.redeploy(dict(YAML), GPU) is False
    assert controller.status() == before and controller.reader is reader
    assert before["seq"] == 1 and before["overrides"] == {"max_decode_sms": 48}
    assert decided(controller, 2.0) == (8, 48)


def test_a_changed_config_redeploy_takes_effect_and_keeps_the_state(kv, cluster):
    """The new section is the base config from the next decision on; the decision count and the forecast go on;
    an override of a field the YAML changed gives way to the YAML (the later word), another one stays."""
    controller = make_controller(YAML, GPU)
    decided(controller, 1.0)
    controller.update_config({"max_decode_sms": 48, "min_decode_sms": 16})
    level = controller.forecaster.to_dict()
    new_yaml = {**YAML, "interval_s": 2.0, "prometheus_url": "http://prom:9090", "max_decode_sms": 64}
    assert controller.redeploy(new_yaml, GPU) is True
    status = controller.status()
    assert status["config"]["interval_s"] == 2.0 and status["overrides"] == {"min_decode_sms": 16}
    assert status["seq"] == 1 and status["forecaster"]["rate"]["level"] == level["rate"]["level"] == 1.0
    assert isinstance(controller.reader, PrometheusReader) and controller.reader.window == "30s"
    assert decided(controller, 2.0) == (16, 64)
    assert kv[("app", "state")]["deployed"]["config"]["max_decode_sms"] == 64


def test_a_redeploy_that_invalidates_an_override_drops_it(kv, cluster):
    controller = make_controller(YAML, GPU)
    controller.update_config({"min_decode_sms": 80})
    assert controller.redeploy({**YAML, "min_decode_sms": 8, "max_decode_sms": 64}, GPU) is True
    assert controller.overrides == {} and controller.cfg.min_decode_sms == 8  # 80 > the new ceiling 64


def test_a_redeploy_keeps_the_overrides_that_still_validate(kv, cluster):
    """One override that conflicts with the new section drops that one only, not every override."""
    controller = make_controller(YAML, GPU)
    controller.update_config({"min_decode_sms": 80, "scale_down_after": 2, "ttft_target_ms": 500.0})
    assert controller.redeploy({**YAML, "max_decode_sms": 64}, GPU) is True
    assert controller.overrides == {"scale_down_after": 2, "ttft_target_ms": 500.0}
    assert (controller.cfg.min_decode_sms, controller.cfg.max_decode_sms, controller.cfg.scale_down_after) == (8, 64, 2)
    assert kv[("app", "state")]["overrides"] == controller.overrides


def test_overrides_that_conflict_with_each_other_keep_the_first_by_name(kv, cluster):
    """Two overrides each valid alone but not together: taken in the order of their names, the first stays."""
    yaml = {**YAML, "max_decode_sms": None, "min_decode_sms": None}
    controller = make_controller(yaml, GPU)
    controller.update_config({"max_decode_sms": 32, "min_decode_sms": 16})
    assert controller.redeploy({**yaml, "interval_s": 1.0}, GPU)
    assert controller.overrides == {"max_decode_sms": 32, "min_decode_sms": 16}  # 16 <= 32: both valid
    controller.overrides = {"min_decode_sms": 16, "max_decode_sms": 8}  # as a saved state from older code may hold
    assert controller.redeploy({**yaml, "interval_s": 2.0}, GPU)
    assert controller.overrides == {"max_decode_sms": 8}  # "max..." before "min...": 16 > 8 drops the floor


def test_overrides_that_validate_only_together_are_kept_together(kv, cluster):
    """Lowering the ceiling under the YAML's floor while dropping the floor (the operator's one change, what the
    Prometheus test's restart keeps): neither validates alone, both together; a restore keeps both."""
    yaml = {**YAML, "min_decode_sms": 32, "max_decode_sms": None}
    controller = make_controller(yaml, GPU)
    lowered = {"min_decode_sms": None, "max_decode_sms": 24}
    assert controller.update_config(lowered) == lowered
    restarted = make_controller(yaml, GPU)  # its own arguments, the saved overrides validated again
    assert restarted.overrides == lowered and restarted.cfg.max_decode_sms == 24
    assert restarted.cfg.min_decode_sms is None


def test_a_redeploy_issued_before_the_last_one_taken_is_ignored(kv, cluster):
    """Two builds in a row queue behind one decision and take the lock in no set order: the later word wins."""
    controller = make_controller(YAML, GPU)
    assert controller.redeploy({**YAML, "max_decode_sms": 64}, GPU, issued_s=200.0) is True
    assert controller.redeploy({**YAML, "max_decode_sms": 80}, GPU, issued_s=100.0) is False
    assert controller.cfg.max_decode_sms == 64
    assert controller.redeploy({**YAML, "max_decode_sms": 80}, GPU, issued_s=300.0) is True
    assert controller.cfg.max_decode_sms == 80
    assert controller.redeploy({**YAML, "max_decode_sms": 72}, GPU) is True  # no time: taken (an older caller)


def test_state_persisted_by_another_version_starts_the_controller_fresh(kv, cluster):
    """A saved field this code no longer has must not fail every start (and so every build) for good."""
    controller = make_controller(YAML, GPU)
    controller.update_config({"scale_down_after": 2})
    controller.tick(reading(0.0, 1.0))
    kv[("app", "state")]["state"]["old_field"] = 1
    fresh = make_controller({**YAML, "interval_s": 7.0}, GPU)
    assert fresh.overrides == {} and fresh.num_restores == 0 and fresh.state.seq == 0
    assert fresh.cfg.interval_s == 7.0 and fresh.last is None


def test_a_controller_leaves_even_when_forgetting_its_state_fails(kv, cluster, monkeypatch):
    controller = make_controller(YAML, GPU)
    exits = []
    controller._exit = lambda: exits.append(1)  # type: ignore[method-assign]

    def broken_delete(app, what):
        raise OSError("KV unreachable")

    monkeypatch.setattr(autoscale, "kv_delete", broken_delete)
    with pytest.raises(OSError):
        controller._leave_if_gone(frozenset(), 0.0) or controller._leave_if_gone(frozenset(), 1e6)
    assert exits == [1] and controller._is_leaving


def test_a_restore_keeps_the_saved_overrides_that_still_validate(kv, cluster):
    controller = make_controller(YAML, GPU)
    controller.update_config({"min_decode_sms": 80, "scale_down_after": 2})
    restarted = make_controller({**YAML, "max_decode_sms": 64}, GPU)  # another actor id: its own arguments
    assert restarted.overrides == {"scale_down_after": 2} and restarted.cfg.max_decode_sms == 64


def test_a_redeploy_of_the_app_spec_reads_the_new_model(kv, cluster):
    controller = make_controller(YAML, GPU)
    assert controller.redeploy(dict(YAML), dataclasses.replace(GPU, model_name="m2")) is True
    assert isinstance(controller.reader, NodeExporterReader) and controller.reader.model_name == "m2"


def test_a_restart_by_ray_keeps_the_redeploys_settings(kv, cluster, monkeypatch):
    """Ray reruns a restarted actor's constructor with its first deploy's arguments: the settings of a redeploy
    since then come from the persisted state. A new actor (another id: a controller started again after one was
    stopped) takes its own arguments."""
    monkeypatch.setattr(controller_module, "_actor_id", lambda: "actor-1")
    controller = make_controller(YAML, GPU)
    decided(controller, 1.0)
    controller.redeploy({**YAML, "max_decode_sms": 64}, dataclasses.replace(GPU, num_engines=2))
    restarted = make_controller(YAML, GPU)
    assert restarted.cfg.max_decode_sms == 64 and restarted.spec.num_engines == 2 and restarted.state.seq == 1
    monkeypatch.setattr(controller_module, "_actor_id", lambda: "actor-2")
    assert make_controller(YAML, GPU).cfg.max_decode_sms == 96


@pytest.mark.parametrize("deployed", [
    {"config": {**YAML, "max_decode_sms": 0}, "spec": dataclasses.asdict(GPU)},  # a value this code rejects
    {"config": {**YAML, "retired_field": 1}, "spec": dataclasses.asdict(GPU)},  # a field it no longer knows
    {"config": dict(YAML), "spec": {**dataclasses.asdict(GPU), "retired_field": 1}},
])
def test_a_restart_with_saved_settings_this_code_rejects_takes_its_arguments(kv, cluster, monkeypatch, deployed):
    """The restarted constructor fell over for good on a saved `deployed` section it rejects; now it logs that and
    takes the arguments Ray passed it, with the rest of the saved state."""
    monkeypatch.setattr(controller_module, "_actor_id", lambda: "actor-1")
    controller = make_controller(YAML, GPU)
    decided(controller, 1.0)
    kv[("app", "state")]["deployed"].update(deployed)
    restarted = make_controller({**YAML, "max_decode_sms": 48}, GPU)
    assert restarted.cfg.max_decode_sms == 48 and restarted.spec == GPU and restarted.state.seq == 1


# start_controller: a found controller that cannot take the settings, or one that is busy deciding -----------------
class FakeRef:
    def __init__(self, result=None, error: Exception | None = None, is_done: bool = True) -> None:
        self.result, self.error, self.is_done = result, error, is_done


class FakeController:
    """A controller actor handle: its `redeploy` answers `ref`; `has_redeploy=False`: one of an older bullet_ray
    whose handle has no such method."""

    def __init__(self, ref: FakeRef, has_redeploy: bool = True) -> None:
        self.ref, self.calls = ref, []
        if has_redeploy:
            self.redeploy = self  # handle.redeploy.remote(...)

    def remote(self, *args):
        self.calls.append(args)
        return self.ref


@pytest.fixture
def fake_ray(monkeypatch):
    """start_controller's Ray calls replaced: `found` the handles _find_or_create answers in turn, `stopped` the
    stop_controller calls."""
    world: dict = {"found": [], "stopped": [], "waits": []}

    def wait(refs, timeout=None):
        world["waits"].append(timeout)
        return [r for r in refs if r.is_done], [r for r in refs if not r.is_done]

    def get(ref, timeout=None):
        assert ref.is_done, "ray.get on a redeploy that is not done would block the build"
        if ref.error is not None:
            raise ref.error
        return ref.result

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(controller_module, "_find_or_create", lambda config, spec: world["found"].pop(0))
    monkeypatch.setattr(controller_module, "stop_controller",
                        lambda app, forget=True: world["stopped"].append((app, forget)))
    monkeypatch.setattr(controller_module, "_wait_until_gone", lambda app: None)
    return world


@pytest.mark.parametrize("old", [
    FakeController(FakeRef(error=ActorDiedError())),  # it crashed on the unknown method, or it is exiting
    FakeController(FakeRef(error=RayTaskError("redeploy", "tb", AttributeError("no redeploy")))),
    FakeController(FakeRef(error=RayTaskError("redeploy", "tb", RuntimeError("controller x is exiting")))),
    FakeController(FakeRef(), has_redeploy=False),
], ids=["died", "no-method", "exiting", "old-handle"])
def test_a_found_controller_that_cannot_redeploy_is_replaced_once(fake_ray, old):
    fresh = FakeController(FakeRef(result=False))
    fake_ray["found"] += [old, fresh]
    assert controller_module.start_controller(ControllerConfig(**YAML), GPU) is fresh
    assert fake_ray["stopped"] == [("app", False)]  # killed, its persisted state kept for the new one
    assert len(fresh.calls) == 1


def test_a_second_failure_raises(fake_ray):
    fake_ray["found"] += [FakeController(FakeRef(error=ActorDiedError())),
                          FakeController(FakeRef(error=ActorDiedError()))]
    with pytest.raises(ActorDiedError):
        controller_module.start_controller(ControllerConfig(**YAML), GPU)
    assert fake_ray["stopped"] == [("app", False)]


def test_a_busy_controller_does_not_hold_up_the_build(fake_ray):
    """A tick holds the decision lock: the redeploy stays queued and the build goes on after a short wait."""
    busy = FakeController(FakeRef(is_done=False))
    fake_ray["found"].append(busy)
    assert controller_module.start_controller(ControllerConfig(**YAML), GPU) is busy
    assert fake_ray["stopped"] == [] and len(busy.calls) == 1
    assert fake_ray["waits"] == [controller_module.REDEPLOY_WAIT_S] and controller_module.REDEPLOY_WAIT_S <= 10


def test_a_redeploy_restarts_the_absence_clock_and_a_leaving_controller_refuses_it(kv, cluster):
    controller = make_controller(YAML, GPU)
    exits = []
    controller._exit = lambda: exits.append(1)  # type: ignore[method-assign]
    assert not controller._leave_if_gone(frozenset(), 0.0)
    controller.redeploy(dict(YAML), GPU)  # the application is being deployed again
    assert not controller._leave_if_gone(frozenset(), controller_module.APP_GONE_S + 1.0) and exits == []
    controller.tick(reading(1.0, 1.0))
    assert controller._leave_if_gone(frozenset(), 2 * controller_module.APP_GONE_S + 1.0) and exits == [1]
    assert ("app", "state") not in kv
    with pytest.raises(RuntimeError, match="exiting"):
        controller.redeploy(dict(YAML), GPU)
