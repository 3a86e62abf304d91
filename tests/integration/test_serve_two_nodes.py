"""Two raylets on one machine: a custom resource `fake_gpu` stands in for one GPU per node, one engine
replica (the real LLMEngine on a tiny dummy model, its prefill/decode workers as Ray actors in the
replica's placement group) per "GPU" on each node, and requests routed to both replicas. Each replica's
stats are read from that replica (DeploymentHandle.broadcast), not sampled through the router, which may send
every stats read to the same one.

The cluster is separate from the session's: this file runs itself in a subprocess (`python
test_serve_two_nodes.py` builds the cluster, drives it and prints a JSON line).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_REQUESTS = 16
NUM_ENGINES = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_engine_per_gpu_on_both_nodes_and_routing_reaches_both():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    served, replica_nodes = result["served"], result["replica_nodes"]  # from every replica itself
    assert len(served) == NUM_ENGINES, result
    assert len(set(replica_nodes.values())) == NUM_ENGINES, result  # one replica on each node
    assert all(count > 0 for count in served.values()), result  # the router sent real requests to both
    assert sum(served.values()) == NUM_REQUESTS, result
    assert result["completion_tokens"] == [4]
    # each replica's two workers sit on its own node, in its fake GPU's bundle: two workers per node
    nodes = result["worker_nodes"]
    assert len(nodes) == 4 and len(set(nodes)) == 2 and nodes.count(nodes[0]) == 2
    assert result["replica_worker_nodes"] == {r: [replica_nodes[r]] * 2 for r in served}, result
    # /v1/internal/stats (through the router) answers with one of those replicas' stats
    via_http = result["via_http"]
    assert served.get(via_http["replica_id"]) == via_http["num_requests_total"], result


def _stats_of_every_replica(handle: Any, timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """`stats` of every engine replica by replica id: one call to each (DeploymentHandle.broadcast), not one to
    whichever replica the router picks. A handle made just now may not list every replica yet (broadcast
    answers from those it knows, or raises DeploymentUnavailableError while it knows none): asked again until
    all NUM_ENGINES answer or timeout_s passes."""
    from ray.serve.exceptions import DeploymentUnavailableError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answers = handle.broadcast("stats").results(timeout_s=30)
            by_replica = {a["replica_id"]: a for a in answers}
        except DeploymentUnavailableError:
            by_replica = {}
        if len(by_replica) >= NUM_ENGINES or time.monotonic() > deadline:
            return by_replica
        time.sleep(0.2)


def _start_serve(serve: Any, attempts: int = 3) -> int:
    """serve.start on a free port, picked once the cluster's own processes hold theirs; a port taken meanwhile
    (the proxy's bind fails) is tried again on another. Returns the port."""
    for attempt in range(attempts):
        port = free_port()
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            return port
        except Exception as e:  # noqa: BLE001 - the proxy's RayTaskError wraps the bind's RuntimeError
            if "Failed to bind" not in str(e) or attempt == attempts - 1:
                raise
            serve.shutdown()
    raise AssertionError("unreachable")


def _main() -> None:
    import asyncio

    import httpx
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors

    from bullet_ray.serve import build_app

    cluster = Cluster()
    for _ in range(2):
        cluster.add_node(num_cpus=4, resources={"fake_gpu": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        port = _start_serve(serve)
        args = {"engine": {"model": "dummy:tiny-llama", "num_kv_blocks": 64, "block_size": 4},
                "num_engines": NUM_ENGINES, "accelerator_resource": "fake_gpu", "engine_num_cpus": 0.5,
                "worker_num_cpus": 0.5}
        serve.run(build_app(args), name="bullet", route_prefix="/")
        url = f"http://127.0.0.1:{port}"

        async def fire() -> list[httpx.Response]:  # concurrent, so load-based routing spreads them
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(
                    client.post(f"{url}/v1/completions", json={"model": "dummy:tiny-llama", "prompt": [5, 6, 7, i],
                                                               "max_tokens": 4, "temperature": 0, "ignore_eos": True})
                    for i in range(NUM_REQUESTS)))

        responses = asyncio.run(fire())
        for r in responses:
            r.raise_for_status()
        per_replica = _stats_of_every_replica(serve.get_deployment_handle("BulletEngine", "bullet"))
        via_http = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()
        workers = list_actors(filters=[("class_name", "=", "WorkerActor"), ("state", "=", "ALIVE")])
        worker_node = {a.pid: a.node_id for a in workers}
        print(json.dumps({
            "served": {r: s["num_requests_total"] for r, s in per_replica.items()},
            "replica_nodes": {r: s["node_id"] for r, s in per_replica.items()},
            "replica_worker_nodes": {r: [worker_node.get(pid) for pid in s["worker_pids"].values()]
                                     for r, s in per_replica.items()},
            "via_http": {k: via_http.get(k) for k in ("replica_id", "num_requests_total")},
            "completion_tokens": sorted({r.json()["usage"]["completion_tokens"] for r in responses}),
            "worker_nodes": sorted(a.node_id for a in workers)}))
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    _main()
