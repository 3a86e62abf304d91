"""The node agent's leaving without a Ray cluster: which applications it serves, the grace period, and the
MPS daemons it stops on the way out (a fake nvidia-cuda-mps-control whose servers a test sets); its state
persisted across Ray's restarts of it (the internal KV replaced by a dict, its actor id by a string); the
controller's recovery from a dead agent handle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
from ray import serve
from ray.exceptions import ActorDiedError, RayTaskError

from bullet_ray.control import autoscale
from bullet_ray.control import node_agent as node_agent_module
from bullet_ray.control.controller import AppSpec, ClusterController
from bullet_ray.control.decide import Decision, EngineDecision
from bullet_ray.control.node_agent import AgentLeavingError, NodeAgent, stop_unused_daemon
from bullet_ray.gpu.mps import MpsDaemon


@pytest.fixture
def mps_root(tmp_path, monkeypatch) -> Path:
    """A fake control binary on PATH: -d creates the control pipe, 'quit' removes it, 'get_server_list'
    answers the lines of <pipe>/servers (none when it is missing)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-cuda-mps-control"
    script.write_text("""#!/bin/sh
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0; fi
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || { echo "Cannot find MPS control daemon process" >&2; exit 1; }
read cmd
case "$cmd" in
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control";;
  get_server_list) cat "$CUDA_MPS_PIPE_DIRECTORY/servers" 2>/dev/null || true;;
  get_client_list*) cat "$CUDA_MPS_PIPE_DIRECTORY/clients_${cmd#get_client_list }" 2>/dev/null || true;;
esac
""")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    monkeypatch.setenv("BULLET_RAY_MPS_ROOT", str(tmp_path / "mps"))
    return tmp_path / "mps"


def with_servers(daemon: MpsDaemon, *pids: int) -> None:
    Path(daemon.pipe_dir, "servers").write_text("".join(f"{p}\n" for p in pids))


def make_agent(app_gone_s: float = 10.0) -> NodeAgent:
    agent = NodeAgent(NODE, app_gone_s=app_gone_s, run_loop=False)
    agent.num_exits = 0  # type: ignore[attr-defined]

    def fake_exit() -> None:
        agent.num_exits += 1  # type: ignore[attr-defined]

    agent._exit = fake_exit  # type: ignore[method-assign]
    return agent


@pytest.fixture
def kv(monkeypatch) -> dict:
    """The internal KV as a dict {(owner, name, what): value}; the agent runs as actor "agent-1"."""
    store: dict = {}
    monkeypatch.setattr(autoscale, "kv_get", lambda name, what, owner="controller": store.get((owner, name, what)))
    monkeypatch.setattr(autoscale, "kv_put",
                        lambda name, what, value, owner="controller": store.__setitem__((owner, name, what), value))
    monkeypatch.setattr(autoscale, "kv_delete", lambda name, what, owner="controller": store.pop((owner, name, what), None))
    monkeypatch.setattr(node_agent_module, "_actor_id", lambda: "agent-1")
    return store


NODE = "node-1" * 4
STATE_KEY = ("node_agent", NODE, "state")


def test_a_daemon_without_servers_is_stopped(mps_root):
    daemon = MpsDaemon("a")
    daemon.start()
    assert stop_unused_daemon(daemon) and not daemon.status().is_running
    assert stop_unused_daemon(daemon)  # not running: nothing to do


def test_a_daemon_whose_server_has_clients_is_kept(mps_root):
    daemon = MpsDaemon("a")
    daemon.start()
    with_servers(daemon, 4242)
    Path(daemon.pipe_dir, "clients_4242").write_text("5001\n5002\n")
    assert daemon.status().may_have_clients and daemon.client_pids(4242) == (5001, 5002)
    assert not stop_unused_daemon(daemon) and daemon.status().is_running


def test_a_daemon_whose_servers_have_no_client_left_is_stopped(mps_root):
    """An MPS server outlives its clients; an idle one does not keep the daemon."""
    daemon = MpsDaemon("a")
    daemon.start()
    with_servers(daemon, 4242)
    assert daemon.client_pids(4242) == ()
    assert stop_unused_daemon(daemon) and not daemon.status().is_running


def test_a_daemon_that_cannot_tell_its_clients_is_kept(mps_root):
    daemon = MpsDaemon("a")
    daemon.start()
    with_servers(daemon, 4242)
    Path(daemon.pipe_dir, "clients_4242").write_text("Server 4242 not found\n")
    assert daemon.client_pids(4242) is None
    assert not stop_unused_daemon(daemon) and daemon.status().is_running


def test_the_agent_leaves_once_its_apps_are_gone_for_the_grace_period(mps_root):
    agent = make_agent(app_gone_s=10.0)
    assert agent.ensure_mps("app-a", "mps-a")
    agent.apps.add(["app-b"])  # what relay("app-b", ...) records before asking Serve
    assert not agent.watch_apps(frozenset({"app-a", "app-b"}), 0.0)
    assert not agent.watch_apps(frozenset({"app-b"}), 1.0)  # one of them still runs
    assert not agent.watch_apps(frozenset(), 2.0)
    assert not agent.watch_apps(None, 30.0)  # unknown: nothing is cleaned up, and the absence clock restarts
    assert not agent.watch_apps(frozenset(), 31.0)
    assert not agent.watch_apps(frozenset({"other"}), 40.9) and agent.num_exits == 0
    assert MpsDaemon("mps-a").status().is_running
    assert agent.watch_apps(frozenset({"other"}), 41.0)
    assert agent.num_exits == 1 and agent._stop.is_set()
    assert not MpsDaemon("mps-a").status().is_running  # no server: no client, stopped


def test_a_redeploy_within_the_grace_period_keeps_the_agent(mps_root):
    agent = make_agent(app_gone_s=10.0)
    agent.ensure_mps("app-a", "mps-a")
    agent.watch_apps(frozenset(), 0.0)
    agent.watch_apps(frozenset({"app-a"}), 8.0)  # deleted and deployed again
    assert not agent.watch_apps(frozenset(), 15.0) and agent.num_exits == 0


def test_the_agent_leaves_but_keeps_a_daemon_that_may_have_clients(mps_root):
    agent = make_agent(app_gone_s=0.0)
    agent.ensure_mps("app-a", "mps-a")
    with_servers(MpsDaemon("mps-a"), 4242)
    Path(MpsDaemon("mps-a").pipe_dir, "clients_4242").write_text("5001\n")
    assert agent.watch_apps(frozenset(), 0.0) and agent.num_exits == 1
    assert MpsDaemon("mps-a").status().is_running


def test_an_agent_leaves_even_when_stopping_a_daemon_fails(mps_root, monkeypatch):
    """Leaving is final: a failure while stopping a daemon must not leave the agent alive and refusing calls."""
    agent = make_agent(app_gone_s=0.0)
    agent.ensure_mps("app-a", "mps-a")

    def broken(daemon):
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(node_agent_module, "stop_unused_daemon", broken)
    assert agent.watch_apps(frozenset(), 0.0)
    assert agent.num_exits == 1 and agent._stop.is_set()


def test_a_leaving_agent_refuses_calls(mps_root, monkeypatch):
    """A controller that found the agent just as it decided to leave must not have it ensure a daemon it is about
    to stop, nor relay through it: both raise, and the controller finds the node's agent again."""
    agent = make_agent(app_gone_s=0.0)
    agent.ensure_mps("app-a", "mps-a")
    assert agent.watch_apps(frozenset(), 0.0)
    with pytest.raises(AgentLeavingError):
        agent.ensure_mps("app-b", "mps-a")
    monkeypatch.setattr(serve, "get_deployment_handle", lambda *args: pytest.fail("relayed by a leaving agent"))
    with pytest.raises(AgentLeavingError):
        agent.relay("app-b", {"seq": 1})
    assert not MpsDaemon("mps-a").status().is_running and agent.apps.app_names == {"app-a"}


def test_a_call_after_the_answer_keeps_the_agent_and_its_daemon(mps_root):
    """An application deployed (and its controller's ensure_mps taken) after serve_app_names() answered: that
    stale answer names none of the served applications, but the call restarted the absence clock."""
    agent = make_agent(app_gone_s=10.0)
    agent.ensure_mps("app-a", "mps-a")
    assert not agent.watch_apps(frozenset(), 0.0)
    stale = frozenset()  # asked at 11.5 s, before app-b existed
    assert agent.ensure_mps("app-b", "mps-a")  # app-b's controller, at 11.8 s
    assert not agent.watch_apps(stale, 12.0) and agent.num_exits == 0
    assert MpsDaemon("mps-a").status().is_running
    assert agent.ensure_mps("app-b", "mps-a")  # still served


def test_the_agent_asks_serve_at_most_every_30_s(monkeypatch):
    """Telemetry runs every 5 s; the question to Serve (one controller asked by every node's agent) does not."""
    asked = []
    monkeypatch.setattr(node_agent_module, "serve_app_names", lambda: asked.append(1) or frozenset({"app-a"}))
    agent = make_agent()
    agent.apps.add(["app-a"])
    for t in range(0, 65, 5):  # the telemetry loop's ticks, 0..60 s
        assert not agent.check_apps(float(t))
    assert len(asked) == 3 == 1 + 60 // node_agent_module.APPS_CHECK_S  # at 0, 30 and 60 s


def test_the_default_grace_period_covers_a_redeploy():
    agent = NodeAgent("n" * 12, period_s=60.0, run_loop=False)
    assert agent.apps.grace_s == 180.0  # three periods when longer than APP_GONE_S
    assert NodeAgent("n" * 12, run_loop=False).apps.grace_s == node_agent_module.APP_GONE_S


class NoEngines:
    """serve.get_deployment_handle(...) of an application whose engines are elsewhere: no answers."""

    def broadcast(self, *args):
        return self

    def results(self, **kwargs):
        return []


def test_a_restarted_agent_knows_its_apps_and_daemons_without_any_call(mps_root, kv, monkeypatch):
    """Ray restarts the agent with its constructor's arguments and the same actor id: the applications and daemons
    come from the persisted state, so it leaves when they go and stops the daemon the first instance ensured."""
    monkeypatch.setattr(serve, "get_deployment_handle", lambda *args: NoEngines())
    agent = make_agent(app_gone_s=10.0)
    assert agent.ensure_mps("app-a", "mps-a")
    assert agent.relay("app-b", {"seq": 1}) == []
    assert kv[STATE_KEY] == {"version": 1, "actor_id": "agent-1", "app_names": ["app-a", "app-b"],
                             "mps_names": ["mps-a"]}
    restarted = make_agent(app_gone_s=10.0)
    assert restarted.apps.app_names == {"app-a", "app-b"} and restarted.mps_names == {"mps-a"}
    assert restarted.num_restores == 1
    assert not restarted.watch_apps(frozenset({"app-b"}), 0.0)
    assert not restarted.watch_apps(frozenset(), 1.0)
    assert restarted.watch_apps(frozenset(), 11.0) and restarted.num_exits == 1
    assert not MpsDaemon("mps-a").status().is_running


def test_an_agent_started_again_does_not_take_another_actors_state(mps_root, kv, monkeypatch):
    """An agent killed without leaving left its state; the one started again under the same name is another actor
    (another id): it starts fresh, and its first call writes its own state over the stale one."""
    make_agent().ensure_mps("app-a", "mps-a")
    monkeypatch.setattr(node_agent_module, "_actor_id", lambda: "agent-2")
    agent = make_agent()
    assert agent.apps.app_names == set() and agent.mps_names == set() and agent.num_restores == 0
    agent.ensure_mps("app-b", "mps-b")
    assert kv[STATE_KEY]["actor_id"] == "agent-2" and kv[STATE_KEY]["app_names"] == ["app-b"]


GOOD = {"version": 1, "actor_id": "agent-1", "app_names": ["app-a"], "mps_names": ["mps-a"]}


@pytest.mark.parametrize("saved", [
    {**GOOD, "version": 2},  # another bullet_ray's format
    {k: v for k, v in GOOD.items() if k != "version"},
    {k: v for k, v in GOOD.items() if k != "mps_names"},
    {**GOOD, "app_names": "app-a"},  # not a list: it must not serve "a", "p", "-"
    {**GOOD, "mps_names": [7]},
    {**GOOD, "mps_names": ["../etc"]},  # a daemon name MpsDaemon rejects
    ["app-a"],
    "corrupt",
], ids=["version-2", "no-version", "no-mps-names", "names-a-string", "name-a-number", "bad-daemon-name", "a-list",
        "a-string"])
def test_persisted_state_of_an_unknown_format_starts_the_agent_fresh(mps_root, kv, saved):
    kv[STATE_KEY] = saved
    agent = make_agent()
    assert agent.apps.app_names == set() and agent.mps_names == set() and agent.num_restores == 0
    agent.ensure_mps("app-b", "mps-b")  # its first call writes its own state
    assert kv[STATE_KEY] == {**GOOD, "app_names": ["app-b"], "mps_names": ["mps-b"]}


def test_an_unreadable_kv_starts_the_agent_fresh(mps_root, kv, monkeypatch):
    def unreadable(name, what, owner="controller"):
        raise json.JSONDecodeError("Expecting value", "\x00", 0)

    kv[STATE_KEY] = GOOD
    monkeypatch.setattr(autoscale, "kv_get", unreadable)
    agent = make_agent()
    assert agent.apps.app_names == set() and agent.num_restores == 0


def test_the_state_is_written_when_it_changes_and_a_failed_write_is_tried_again(mps_root, kv, monkeypatch):
    monkeypatch.setattr(serve, "get_deployment_handle", lambda *args: NoEngines())
    agent = make_agent()
    writes = []
    put = autoscale.kv_put

    def counted_put(name, what, value, owner="controller"):
        writes.append(value)
        if len(writes) == 1:
            raise OSError("KV unreachable")
        put(name, what, value, owner=owner)

    monkeypatch.setattr(autoscale, "kv_put", counted_put)
    assert agent.ensure_mps("app-a", "mps-a")  # the failed write does not fail the call
    assert STATE_KEY not in kv
    agent.relay("app-a", {"seq": 1})  # nothing changed, but the last write failed: written now
    agent.relay("app-a", {"seq": 2})  # nothing changed: not written again
    assert len(writes) == 2 and kv[STATE_KEY]["mps_names"] == ["mps-a"]


def test_a_leaving_agent_deletes_its_persisted_state(mps_root, kv, monkeypatch):
    """After stopping its daemons (an instance Ray restarts in between still knows them), before it exits."""
    agent = make_agent(app_gone_s=0.0)
    agent.ensure_mps("app-a", "mps-a")
    assert STATE_KEY in kv
    stop = node_agent_module.stop_unused_daemon
    seen = []

    def stop_while_the_state_is_kept(daemon):
        seen.append(STATE_KEY in kv)
        return stop(daemon)

    monkeypatch.setattr(node_agent_module, "stop_unused_daemon", stop_while_the_state_is_kept)
    assert agent.watch_apps(frozenset(), 0.0) and agent.num_exits == 1
    assert seen == [True]
    assert STATE_KEY not in kv
    assert make_agent().apps.app_names == set()  # Ray restarting it now (it was not killed yet) finds nothing


def test_an_agent_leaves_even_when_deleting_its_state_fails(mps_root, kv, monkeypatch):
    agent = make_agent(app_gone_s=0.0)
    agent.ensure_mps("app-a", "mps-a")

    def broken_delete(name, what, owner="controller"):
        raise OSError("KV unreachable")

    monkeypatch.setattr(autoscale, "kv_delete", broken_delete)
    assert agent.watch_apps(frozenset(), 0.0) and agent.num_exits == 1
    assert not MpsDaemon("mps-a").status().is_running


def test_outside_an_actor_nothing_is_persisted(mps_root, monkeypatch):
    def no_kv(*args, **kwargs):
        pytest.fail("the internal KV was used outside an actor")

    for fn in ("kv_get", "kv_put", "kv_delete"):
        monkeypatch.setattr(autoscale, fn, no_kv)
    agent = make_agent(app_gone_s=0.0)
    assert agent.actor_id is None and agent.ensure_mps("app-a", "mps-a")
    assert agent.watch_apps(frozenset(), 0.0)


class DeadAgent:
    """An actor handle of an agent that left: every call fails like Ray's."""

    class _Method:
        def remote(self, *args):
            return ActorDiedError()

    relay = ensure_mps = _Method()


class LeavingAgent:
    """An actor handle of an agent that is leaving: every call fails with its AgentLeavingError."""

    class _Method:
        def remote(self, *args):
            return RayTaskError("relay", "tb", AgentLeavingError("leaving"))

    relay = ensure_mps = _Method()


class LiveAgent:
    class _Method:
        def remote(self, *args):
            return [{"engine_id": "e0"}]

    relay = ensure_mps = _Method()


@pytest.mark.parametrize("gone_agent", [DeadAgent(), LeavingAgent()], ids=["dead", "leaving"])
def test_a_dead_agent_handle_makes_the_controller_find_agents_again(monkeypatch, gone_agent):
    starts = []
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": "n1", "Alive": True}])

    def fake_get(refs, timeout=None):
        for r in refs:
            if isinstance(r, Exception):
                raise r
        return refs

    monkeypatch.setattr(ray, "get", fake_get)
    agents = iter([{"n1": gone_agent}, {"n1": LiveAgent()}])
    monkeypatch.setattr(node_agent_module, "start_node_agents",
                        lambda accelerator: starts.append(accelerator) or next(agents))
    monkeypatch.setattr(autoscale, "kv_get", lambda app, what: None)  # nothing persisted: no Ray KV needed

    def no_serve(*args):
        raise RuntimeError("no Serve here")

    monkeypatch.setattr(serve, "get_deployment_handle", no_serve)
    ray_was_up = ray.is_initialized()  # (a Ray session of tests run before this one in the same process)
    controller = ClusterController({"app_name": "x"}, AppSpec("m", None, 1, mps_name="mps-a"), run_loop=False)
    decision = Decision(1, 0.0, 1, "queue", 0.0, 0.0, (), EngineDecision("*"))
    assert controller._push(decision) == []  # the agent is gone: the direct broadcast (no Serve here) fails too
    assert ray.is_initialized() == ray_was_up  # the controller started no Ray of its own
    assert controller._agents == {}
    assert controller._push(decision) == [{"engine_id": "e0"}]  # found again, and answers
    assert len(starts) == 2


def test_the_state_of_agents_on_departed_nodes_is_deleted(kv, monkeypatch):
    """A node id is never reused: once its node is gone no agent reads or deletes its key, so starting the agents
    deletes the keys of nodes not alive (and only those); a KV that fails is logged, not raised."""
    from bullet_ray.control.node_agent import forget_departed_nodes

    for node in ("alive-1", "gone-1", "gone-2"):
        kv[("node_agent", node, "state")] = GOOD
    kv[("controller", "gone-1", "state")] = {"other": "owner"}
    monkeypatch.setattr(autoscale, "kv_names",
                        lambda owner: sorted({name for o, name, _ in kv if o == owner}))
    asked = []

    def alive():  # asked after the keys are listed
        asked.append(sorted(name for _, name, _ in kv))
        return {"alive-1", "alive-2"}

    assert forget_departed_nodes(alive) == ["gone-1", "gone-2"]
    assert asked == [["alive-1", "gone-1", "gone-1", "gone-2"]]
    assert set(kv) == {("node_agent", "alive-1", "state"), ("controller", "gone-1", "state")}

    def broken(owner):
        raise OSError("KV unreachable")

    monkeypatch.setattr(autoscale, "kv_names", broken)
    assert forget_departed_nodes(lambda: set()) == []
