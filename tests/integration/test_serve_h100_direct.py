"""serve_h100's "+direct" lifecycle for real on a CPU: `serve run` of deploy/local.yaml (its two ports moved to
free ones) with RAY_SERVE_ENABLE_DIRECT_INGRESS=1, the replica's URL found from this process through
benchmarks.direct_ingress, a completion over HTTP to it, and `serve run` stopped."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.compare import SystemSpec
from benchmarks.gpu.serve_h100 import serve_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("serve_env", [{}, {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"}], ids=["direct", "throughput"])
def test_direct_system_sweeps_the_replica_url(tmp_path, monkeypatch, serve_env):
    """With RAY_SERVE_THROUGHPUT_OPTIMIZED=1 too (Ray Serve's high-throughput mode: user code on the replica's
    own loop, gRPC between deployments, direct ingress on, garbage collection frozen after start-up)."""
    from ray._private.services import find_gcs_addresses

    if find_gcs_addresses():  # the lookup connects to "the" local cluster: another one would be ambiguous
        pytest.skip("another Ray cluster runs on this machine")
    config = yaml.safe_load((ROOT / "deploy" / "local.yaml").read_text())
    config["http_options"]["port"], config["grpc_options"]["port"] = _free_port(), _free_port()
    base_yaml = tmp_path / "local.yaml"
    base_yaml.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])  # `serve`
    monkeypatch.setenv("PYTHONPATH", str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    system = SystemSpec("bullet+direct", f"http://127.0.0.1:{config['http_options']['port']}", ready_timeout_s=240,
                        extra={"base_yaml": str(base_yaml), "serve_env": serve_env})
    try:
        with serve_run(system, tmp_path / "out"):
            info = system.extra["direct_ingress"]
            assert info == {"env": "RAY_SERVE_ENABLE_DIRECT_INGRESS=1", "base_url": system.base_url}
            port = int(system.base_url.rsplit(":", 1)[1])
            assert port != config["http_options"]["port"] and port >= 30000, system.base_url
            r = httpx.post(f"{system.base_url}/v1/completions", timeout=60,
                           json={"prompt": [1000, 1001, 1002], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
    except (TimeoutError, RuntimeError) as e:
        log = tmp_path / "out" / "bullet+direct-serve.log"
        pytest.fail(f"{e}\n{log.read_text()[-3000:] if log.exists() else ''}")
