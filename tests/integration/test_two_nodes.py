"""Two raylets on one machine: one engine replica (and its worker pair) per fake GPU on each node, and
requests routed to both."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_engine_per_gpu_on_both_nodes_and_routing_reaches_both():
    script = os.path.join(os.path.dirname(__file__), "two_node_app.py")
    proc = subprocess.run([sys.executable, script, str(free_port())], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert len(result["served"]) == 2, result
    assert len(set(result["replica_nodes"].values())) == 2  # one replica on each node
    assert all(count > 0 for count in result["served"].values()), result  # the router used both
    assert sum(result["served"].values()) == 16
    assert result["completion_tokens"] == [4]
    # each replica's two workers sit on its own node: two workers per node
    nodes = result["worker_nodes"]
    assert len(nodes) == 4 and len(set(nodes)) == 2 and nodes.count(nodes[0]) == 2
