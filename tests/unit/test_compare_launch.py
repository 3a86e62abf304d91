"""The comparison runner's launched servers: never measure a server it did not start, never leave one running.

On a GPU lease a `vllm serve` left by a sweep killed at its time limit kept the port and the GPU; the next call's
vLLM failed to start and its sweep measured the old server (benchmarks/results/serve_h200_m7/README.md).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bullet_ray.bench.compare import SystemSpec, answers, launched


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _static_server(root: Path, port: int) -> str:
    """A command serving `root` over HTTP: GET /v1/models answers 200 (a file), like an OpenAI server."""
    (root / "v1").mkdir(parents=True, exist_ok=True)
    (root / "v1" / "models").write_text("{}")
    return f"{sys.executable} -m http.server {port} --bind 127.0.0.1 --directory {root}"


def _wait_answers(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers(url, timeout_s=0.5):
        assert time.monotonic() < deadline, f"{url} never answered"
        time.sleep(0.1)


def test_launch_refused_while_another_server_answers_at_its_address(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    other = subprocess.Popen(_static_server(tmp_path / "www", port).split())
    try:
        _wait_answers(url)
        marker = tmp_path / "launched"
        spec = SystemSpec("vllm", url, launch=f"touch {marker}", ready_timeout_s=5)
        with pytest.raises(RuntimeError, match="already answers before vllm was started"), \
                launched(spec, tmp_path / "out"):
            pass
        assert not marker.exists()  # its launch command never ran
    finally:
        other.terminate()
        other.wait(timeout=10)


def _runner(tmp_path: Path, port: int, hang_on_exit: bool = False) -> subprocess.Popen:
    """A runner (stop_on_sigterm, then `launched` with a static server on `port`) that has printed "ready"; with
    `hang_on_exit`, its unwinding hangs in a `finally`."""
    body = "time.sleep(120)" if not hang_on_exit else "try:\n    time.sleep(120)\nfinally:\n    time.sleep(120)"
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from bullet_ray.bench.compare import SystemSpec, launched, stop_on_sigterm
        stop_on_sigterm()
        spec = SystemSpec("srv", "http://127.0.0.1:{port}", launch={_static_server(tmp_path / 'www', port)!r},
                          ready_timeout_s=20)
        with launched(spec, Path({str(tmp_path / 'out')!r})):
            print("ready", flush=True)
    """) + textwrap.indent(body, "    ") + "\n"
    runner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert runner.stdout is not None and runner.stdout.readline().strip() == "ready"
    return runner


def test_sigterm_stops_the_launched_server_before_the_runner_exits(tmp_path: Path) -> None:
    """`timeout` at a call's limit sends SIGTERM: the runner exits through `launched`'s finally, which stops the
    server's process group, so the port is free for the next run."""
    port = _free_port()
    runner = _runner(tmp_path, port)
    try:
        assert answers(f"http://127.0.0.1:{port}")
        os.kill(runner.pid, signal.SIGTERM)
        assert runner.wait(timeout=30) == 128 + signal.SIGTERM
        assert not answers(f"http://127.0.0.1:{port}", timeout_s=0.5)  # the server went with it
    finally:
        if runner.poll() is None:
            runner.kill()


def test_sigterm_stops_the_server_even_when_the_unwinding_hangs(tmp_path: Path) -> None:
    """The handler signals every launched group before it raises: a `finally` that hangs (an asyncio run cancelling
    its tasks did, on a GPU lease) no longer keeps the server up until `timeout` kills the runner."""
    port = _free_port()
    runner = _runner(tmp_path, port, hang_on_exit=True)
    try:
        os.kill(runner.pid, signal.SIGTERM)
        os.kill(runner.pid, signal.SIGTERM)  # timeout signals the child, then its group: the handler runs once
        deadline = time.monotonic() + 15
        while answers(f"http://127.0.0.1:{port}", timeout_s=0.5):
            assert time.monotonic() < deadline, "the server outlived the SIGTERM"
            time.sleep(0.1)
        assert runner.poll() is None  # still in its hanging finally
    finally:
        runner.kill()
        runner.wait(timeout=10)
