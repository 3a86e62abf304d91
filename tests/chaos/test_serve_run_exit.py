"""`serve run` (the CLI, on a Ray cluster of its own) stopped the ways a user stops it: Ctrl-C (SIGINT to its
process group, as a terminal sends it) and SIGTERM (a service manager). The config is deploy/local.yaml with
free ports, a tiny dummy model (the shutdown paths do not depend on the model) and a short drain grace.
Afterwards the engine's runtime folder in /dev/shm is gone and none of its processes runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import pytest
import yaml

from benchmarks.faults import free_port, wait_for
from bullet_ray.engine.runtime_dir import EngineFolder, ProcessRef, read_pid_file

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STARTUP_TIMEOUT_S = 300
EXIT_TIMEOUT_S = 60


def _interruptible() -> None:
    """In the child: SIGINT back to its default, as a terminal's Ctrl-C finds it. A test run launched in the
    background of a non-interactive shell inherits SIGINT ignored, and `serve run` would then never see it
    (two clean-clone CI runs started with `nohup bash -c ... &` failed so on 2026-11-26)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _config(path, http_port: int) -> None:
    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        config = yaml.safe_load(f)
    config["http_options"]["port"] = http_port
    config["grpc_options"]["port"] = free_port()
    args = config["applications"][0]["args"]
    args["engine"] = {"model": "dummy:tiny-llama", "num_kv_blocks": 256}
    args["drain_grace_s"] = 2.0
    path.write_text(yaml.safe_dump(config))


def _engine(url: str) -> EngineFolder:
    stats = httpx.get(f"{url}/v1/internal/stats", timeout=30).json()
    folder = stats["runtime_dir"]
    front = read_pid_file(os.path.join(folder, "owner.pid"))
    assert front is not None and front.pid == stats["pid"]
    workers = {role: ProcessRef.of(pid) for role, pid in stats["worker_pids"].items()}
    assert set(workers) == {"prefill", "decode"} and folder.startswith("/dev/shm/")
    return EngineFolder(folder, front, workers)


def _long_stream(url: str, outcome: list[str]) -> threading.Thread:
    def run() -> None:
        body = {"model": "dummy:tiny-llama", "prompt": [5, 6, 7], "max_tokens": 1000, "ignore_eos": True,
                "stream": True, "n": 8}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=EXIT_TIMEOUT_S) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        outcome.append("error" if "error" in event else "chunk")
            outcome.append("closed")
        except httpx.TimeoutException:
            outcome.append("hung")
        except httpx.HTTPError:
            outcome.append("cut")  # the whole cluster went away under it: the connection dropped

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_stopping_serve_run_releases_the_engine(tmp_path, how):
    http_port = free_port()
    _config(tmp_path / "local.yaml", http_port)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([serve_cli, "run", "--address", "local", str(tmp_path / "local.yaml")], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=_interruptible)
    url = f"http://127.0.0.1:{http_port}"
    try:
        def ready() -> bool:
            try:
                return httpx.get(f"{url}/v1/internal/stats", timeout=5).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None
        assert wait_for(ready, STARTUP_TIMEOUT_S, 2.0) and proc.poll() is None, log_path.read_text()[-3000:]
        engine = _engine(url)
        outcome: list[str] = []
        stream = _long_stream(url, outcome)
        assert wait_for(lambda: "chunk" in outcome, 60, 0.05), outcome
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve run still running {EXIT_TIMEOUT_S} s after {how}; its log ends:\n"
                        + log_path.read_text()[-4000:])
        stream.join(EXIT_TIMEOUT_S)
        assert outcome and outcome[-1] in ("closed", "cut"), outcome
        assert wait_for(engine.is_gone, EXIT_TIMEOUT_S, 0.5), (engine, os.listdir(engine.path)
                                                             if os.path.exists(engine.path) else None)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
