"""The real `serve run deploy/local.yaml` CLI in a subprocess, on a Ray cluster of its own.

The YAML is deploy/local.yaml with only its two ports changed to free ones (the shipped 8000/9000 may be
taken on a shared machine); everything else, the builder's import path and args included, is as shipped.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import httpx
import pytest
import yaml

from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
from bullet_ray.serve.proto.generate_pb2_grpc import GeneratorStub

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, log_path: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            with open(log_path) as f:
                pytest.fail(f"serve run exited with {proc.returncode}:\n{f.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    with open(log_path) as f:
        pytest.fail(f"serve run did not come up in {STARTUP_TIMEOUT_S} s:\n{f.read()[-3000:]}")


def test_serve_run_local_yaml(tmp_path):
    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        config = yaml.safe_load(f)
    http_port, grpc_port = free_port(), free_port()
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = grpc_port
    config_path = tmp_path / "local.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = str(tmp_path / "serve.log")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    with open(log_path, "w") as log:
        # --address local: a fresh cluster, never one that happens to run on this machine
        proc = subprocess.Popen([serve_cli, "run", "--address", "local", str(config_path)], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http_port}"
    try:
        _wait_ready(url, proc, log_path)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": "smollm2-135m-instruct", "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"].startswith("The capital of France is Paris.")
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            responses = list(GeneratorStub(channel).Generate(
                GenerateRequest(prompt="What is the capital of France?", chat=True, max_tokens=16,
                                temperature=0.0),
                metadata=(("application", config["applications"][0]["name"]),)))
        assert "".join(x.text for x in responses) == r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGINT)  # serve run shuts Serve and its local Ray cluster down
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the process group this test started
            proc.wait(timeout=30)
