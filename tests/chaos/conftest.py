"""Fixtures of the chaos suite: a local Ray cluster with Serve for this folder.

The cluster is package-scoped (tests/chaos is a package for that) and shut down at the end of tests/chaos
(these tests kill processes; the integration suite's session cluster starts afresh after them). When a Ray session is already running in
this process (tests/integration ran first in the same pytest run), it and its Serve instance are reused.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.faults import free_port

NUM_CPUS = 8  # what Ray schedules with; the actors reserve 0 or fractions, the 2 real cores are shared


@pytest.fixture(scope="package")
def chaos_serve_url() -> Iterator[str]:
    """The HTTP address of Serve on a local Ray cluster."""
    import ray
    from ray import serve

    if ray.is_initialized():  # another suite's session cluster: reuse it and leave it running
        from ray.serve.context import _get_global_client

        yield f"http://127.0.0.1:{_get_global_client().http_config.port}"
        return
    http_port, metrics_port = free_port(), free_port()
    ray.init(address="local", num_cpus=NUM_CPUS, include_dashboard=False, log_to_driver=False,
             _metrics_export_port=metrics_port, runtime_env={"env_vars": {"BULLET_RAY_LOG_LEVEL": "WARNING"}})
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    try:
        yield f"http://127.0.0.1:{http_port}"
    finally:
        serve.shutdown()
        ray.shutdown()
