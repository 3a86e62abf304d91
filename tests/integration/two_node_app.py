"""Run by test_two_nodes.py in its own process: a two-node Ray cluster on this machine (two raylets), a
custom resource `fake_gpu` standing in for one GPU per node, and one engine replica per "GPU"."""

from __future__ import annotations

import json
import sys
import time

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

from bullet_ray.serve import build_app


def main(port: int) -> None:
    cluster = Cluster()
    cluster.add_node(num_cpus=4, resources={"fake_gpu": 1})
    cluster.add_node(num_cpus=4, resources={"fake_gpu": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"engine": {"model": "dummy:tiny-llama", "num_kv_blocks": 64, "block_size": 4},
            "num_engines": 2, "accelerator_resource": "fake_gpu", "engine_num_cpus": 0.5, "worker_num_cpus": 0.5}
    serve.run(build_app(args), name="bullet", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    texts = set()
    for i in range(16):
        r = httpx.post(f"{url}/v1/completions", json={"model": "dummy:tiny-llama", "prompt": [5, 6, 7, i],
                                                      "max_tokens": 4, "temperature": 0}, timeout=60)
        r.raise_for_status()
        texts.add(r.json()["usage"]["completion_tokens"])
    served: dict[str, int] = {}
    nodes: dict[str, str] = {}
    for _ in range(40):
        stats = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()
        served[stats["replica_id"]] = stats["num_requests_total"]
        nodes[stats["replica_id"]] = stats["node_id"]
    workers = [a for a in list_actors(filters=[("class_name", "=", "WorkerActor"), ("state", "=", "ALIVE")])]
    print(json.dumps({"served": served, "replica_nodes": nodes, "completion_tokens": sorted(texts),
                      "worker_nodes": sorted(a.node_id for a in workers)}))
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    start = time.time()
    main(int(sys.argv[1]))
    print(f"took {time.time() - start:.0f} s", file=sys.stderr)
