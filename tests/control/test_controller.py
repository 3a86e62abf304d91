"""The cluster controller's own logic without a Ray cluster: its engine budget and its decisions over time
(the internal KV replaced by a dict, the push to engines by a list, the cluster's resources by a dict)."""

from __future__ import annotations

import pytest
import ray

from bullet_ray.control import autoscale
from bullet_ray.control import controller as controller_module
from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.controller import AppSpec, ClusterController, controller_options, engine_budget
from bullet_ray.control.forecast import LoadSample
from bullet_ray.control.readings import ClusterReading
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
    ({}, AppSpec("m", "GPU", 1), {"GPU": 8.0, "CPU": 128.0}, 8),  # one per GPU, whatever the CPUs
    ({}, AppSpec("m", "GPU", 3), {"GPU": 2.0}, 3),  # never below num_engines
])
def test_engine_budget(config, spec, resources, budget):
    assert engine_budget(ControllerConfig(**config), spec, resources) == budget


def test_cpu_spec_counts_the_reserved_cpus():
    ray_workers = BulletAppConfig(engine_num_cpus=1, worker_num_cpus=1.5, controller={})
    processes = BulletAppConfig(engine_num_cpus=1, worker_num_cpus=1.5, worker_launcher="process", controller={})
    assert AppSpec.of(ray_workers).cpus_per_engine == 4.0 and AppSpec.of(ray_workers).accelerator is None
    assert AppSpec.of(processes).cpus_per_engine == 1.0


def test_serve_may_scale_a_cpu_app_past_its_configured_replicas(monkeypatch, cluster):
    cluster["CPU"] = 16.0
    started = []
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(controller_module, "start_controller", lambda cfg, spec: started.append(spec))
    app = BulletAppConfig(num_engines=2, controller={})  # 3 CPUs per engine by default (front + 2 workers)
    options = controller_options(app)
    assert options["autoscaling_config"]["max_replicas"] == 5
    assert options["autoscaling_config"]["initial_replicas"] == 2
    assert started == [AppSpec(app.model_name, None, 2, 3.0, None)]


def test_a_cpu_app_scales_down_and_up_again(kv, cluster):
    """On CPU without max_engines the budget was the replica count of the moment: once scaled down to one,
    demand for three engines held it at one (and shed). Now the cluster's 16 CPUs hold five engines."""
    cluster["CPU"] = 16.0
    config = {"engine_capacity_tokens_s": 100.0, "target_utilization": 1.0, "scale_down_after": 1, "horizon_s": 0.0}
    controller = make_controller(config, CPU)
    low = controller.tick(reading(1.0, 0.5))  # 10 tok/s: one engine
    high = controller.tick(reading(2.0, 15.0))  # 300 tok/s: three
    assert (low["decision"]["num_replicas"], low["inputs"]["max_engines"]) == (1, 5)
    assert (high["decision"]["num_replicas"], high["inputs"]["max_engines"], high["decision"]["mode"]) == (3, 5, "queue")
    assert kv[(controller.app, "num_replicas")] == 3 and len(controller.pushed) == 2
