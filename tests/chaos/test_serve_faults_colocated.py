"""The chaos suite's faults on the colocated layout (`colocate_ingress: true`, deploy/gpu.yaml's): the OpenAI
routes run in the engine replica, so one process holds the routes, the engine front and the streams.

- a killed decode worker: the replica lives on, its streams end with an error event, new requests get 200
  from the other replica or 503/429 with Retry-After, and Serve replaces the replica (failed health checks);
- a killed replica process: the process that writes its streams is gone, so they end with the connection cut
  (a transport error at the client, never a clean finish that hides the loss); Serve replaces it.
Either way nothing of the dead engine is left behind (runtime folder, worker processes).
"""

from __future__ import annotations

import pytest

from tests.chaos.test_serve_faults import _args, _kill_under_load

pytestmark = [pytest.mark.ray, pytest.mark.slow]

APP, PREFIX = "chaos_colocated", "/chaos_colocated"


@pytest.fixture(scope="module")
def colocated_app(chaos_serve_url, tmp_path_factory):
    from ray import serve

    from bullet_ray.serve import build_app

    base = str(tmp_path_factory.mktemp("chaos_colocated_runtime"))
    serve.run(build_app({**_args(base, 2), "colocate_ingress": True}), name=APP, route_prefix=PREFIX)
    yield chaos_serve_url + PREFIX, base
    serve.delete(APP)


def test_colocated_decode_worker_kill(colocated_app):
    url, base = colocated_app
    _kill_under_load(url, base, lambda victim: victim.workers["decode"].pid)


def test_colocated_replica_kill_cuts_its_streams(colocated_app):
    url, base = colocated_app
    _kill_under_load(url, base, lambda victim: victim.front.pid, streams_may_be_cut=True)
