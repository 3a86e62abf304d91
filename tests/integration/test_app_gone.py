"""What serves an application leaves once it is gone, on a real Ray cluster:
- a node agent (tiny grace period) whose application never ran kills itself, for good (max_restarts=-1 as
  in production, so a plain death would have been restarted);
- `serve_app_names()` in a long-lived actor after `serve.shutdown()`: no apps, and once Serve runs again its
  applications (Ray Serve's cached client of the dead controller dropped). This part shuts Serve down, so it
  runs on a cluster of its own: this file runs itself in a subprocess (`python test_app_gone.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.ray]


def test_an_agent_without_a_live_app_exits(ray_session):
    import ray

    from bullet_ray.control.node_agent import NodeAgent

    node_id = f"test-app-gone-{os.getpid()}"  # its own key for the persisted state: not the node's real agent's
    agent = ray.remote(NodeAgent).options(  # type: ignore[attr-defined]
        name=f"test_agent_leaves:{os.getpid()}", namespace="bullet_ray", num_cpus=0, max_restarts=-1,
    ).remote(node_id, None, period_s=0.2, app_gone_s=0.5, apps_check_s=0.2)
    assert not ray.get(agent.ensure_mps.remote("no_such_app", "test_app_gone"))  # no MPS here; the app is recorded
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(agent.telemetry.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the agent did not exit within 30 s")
    time.sleep(2)  # a restart by Ray would answer again by now
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(agent.telemetry.remote(), timeout=10)


def test_serve_app_names_after_serve_shutdown():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def _own_cluster() -> None:
    import ray
    from ray import serve

    from bullet_ray.control.serve_apps import serve_app_names

    @ray.remote(num_cpus=0)
    class Asker:  # long-lived, like the controller: keeps Ray Serve's cached client between calls
        def names(self):
            return serve_app_names()

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class Hello:
        def __call__(self) -> str:
            return "hello"

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"port": 0})
        serve.run(Hello.bind(), name="first", route_prefix="/first")
        asker = Asker.remote()
        assert ray.get(asker.names.remote()) == {"first"}
        serve.shutdown()
        assert ray.get(asker.names.remote()) == frozenset()  # no Serve controller: no apps
        serve.start(http_options={"port": 0})
        serve.run(Hello.bind(), name="second", route_prefix="/second")
        assert ray.get(asker.names.remote()) == {"second"}  # the dead controller's client dropped
        print("OK")
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    _own_cluster()


def test_persisted_agent_state_lists_and_deletes_in_rays_kv(ray_session):
    """autoscale.kv_names / kv_delete against Ray's internal KV: the names an owner persisted under, and only the
    departed nodes' agent state deleted."""
    from bullet_ray.control import autoscale
    from bullet_ray.control.node_agent import KV_OWNER, forget_departed_nodes

    alive, gone = f"kv-alive-{os.getpid()}", f"kv-gone-{os.getpid()}"
    for node in (alive, gone):
        autoscale.kv_put(node, "state", {"version": 1}, owner=KV_OWNER)
    assert {alive, gone} <= set(autoscale.kv_names(KV_OWNER))
    others_alive = set(autoscale.kv_names(KV_OWNER)) - {gone}  # (other tests' agents in this session stay)
    assert forget_departed_nodes(lambda: others_alive) == [gone]
    assert autoscale.kv_get(gone, "state", owner=KV_OWNER) is None
    assert autoscale.kv_get(alive, "state", owner=KV_OWNER) == {"version": 1}
    autoscale.kv_delete(alive, "state", owner=KV_OWNER)
