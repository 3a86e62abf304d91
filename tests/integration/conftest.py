"""One local Ray cluster and one Serve instance (HTTP + gRPC proxies on free ports) per test session.

`ray_cluster` starts Ray once, lazily, for the first test that needs it and shuts it down at the end of
the session; `serve_url` / `serve_grpc_address` start Serve on it. Tests that need a cluster of their own
(the two-node test) run it in a subprocess, so the session cluster is never restarted.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import pytest

# "CPUs" Ray schedules with; actors of the Serve tests reserve 0 or fractions, so the machine's 2 real
# cores are shared, not reserved
NUM_SESSION_CPUS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RaySession:
    http_url: str
    grpc_address: str
    metrics_url: str


@pytest.fixture(scope="session")
def ray_session():
    import ray
    from ray import serve
    from ray.serve.config import gRPCOptions

    from bullet_ray.serve.config import GRPC_SERVICER_FUNCTION

    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    # address="local": always a fresh cluster; without it ray.init joins any Ray cluster found running on
    # this machine (another test session's, a CI run's)
    # fake_gpu: a custom resource standing in for GPUs (the control-plane tests' GPU budget); metrics are
    # exported every 2 s instead of Ray's 10 s so tests reading them wait less
    ray.init(address="local", num_cpus=NUM_SESSION_CPUS, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port, resources={"fake_gpu": 2},
             _system_config={"metrics_report_interval_ms": 2000},
             runtime_env={"env_vars": {"BULLET_RAY_LOG_LEVEL": "WARNING"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port},
                grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[GRPC_SERVICER_FUNCTION]))
    yield RaySession(f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                     f"http://127.0.0.1:{metrics_port}/metrics")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_url(ray_session: RaySession) -> str:
    return ray_session.http_url
