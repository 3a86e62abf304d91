"""Shared pieces of the reliability scripts (recovery.py, overload.py, soak.py): start `serve run` on a
deploy config as a subprocess, find an engine's processes, read process memory, stream one request.

Everything here talks to a deployment over HTTP (the OpenAI API and /v1/internal/stats) and reads /proc,
so it works the same on a laptop and on a GPU node.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Any, timeout_s: float, interval_s: float = 0.2) -> bool:
    """Poll `condition()` until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval_s)
    return bool(condition())


def device_name() -> str:
    """The GPU's name when torch sees one, else the CPU model."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"CPU: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


def provenance() -> dict[str, Any]:
    return {"device": device_name(), "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]), "host": socket.gethostname()}


def memory_bytes(pid: int) -> dict[str, int]:
    """VmRSS (everything resident, shared weights and KV pages included) and RssAnon (private heap: what a
    leak grows) of a process; empty when it is gone."""
    found: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon"):
                    found["rss" if key == "VmRSS" else "rss_anon"] = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return found


def open_files(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def dir_bytes(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def engine_stats(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/v1/internal/stats", timeout=timeout_s, headers=headers)
    r.raise_for_status()
    return r.json()


def engine_processes(url: str, num_polls: int = 4) -> tuple[dict[str, int], list[str]]:
    """name -> pid of every engine process the deployment reports, and their runtime folders. The stats route
    answers from one replica per call, so it is polled a few times to see every local replica."""
    pids: dict[str, int] = {}
    folders: list[str] = []
    for _ in range(num_polls):
        stats = engine_stats(url)
        replica = str(stats.get("replica_id", "replica"))
        pids[f"{replica}/front"] = int(stats["pid"])
        for role, pid in (stats.get("worker_pids") or {}).items():
            pids[f"{replica}/{role}"] = int(pid)
        if stats.get("runtime_dir") and stats["runtime_dir"] not in folders:
            folders.append(stats["runtime_dir"])
    return pids, folders


def model_name(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


class ServeRun:
    """`serve run <config>` on a fresh local Ray cluster, with the config's HTTP/gRPC ports moved to free ones."""

    def __init__(self, config_path: str, log_path: str | None = None, overrides: dict[str, Any] | None = None):
        with open(config_path) as f:
            config = yaml.safe_load(f)
        self.http_port = free_port()
        config.setdefault("http_options", {})["port"] = self.http_port
        if "grpc_options" in config:
            config["grpc_options"]["port"] = free_port()
        args = config["applications"][0].setdefault("args", {})
        for key, value in (overrides or {}).items():  # "engine.model" -> args["engine"]["model"]
            *path, last = key.split(".")
            target = args
            for part in path:
                target = target.setdefault(part, {})
            target[last] = value
        self.folder = tempfile.mkdtemp(prefix="bullet_ray_serve_run_")
        self.config_path = os.path.join(self.folder, "config.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.log_path = log_path or os.path.join(self.folder, "serve.log")
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 900.0) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        # beside this interpreter (a venv), else on PATH (a --target install, as on the GPU machine)
        serve_cli = os.path.join(os.path.dirname(sys.executable), "serve")
        if not os.path.exists(serve_cli):
            serve_cli = shutil.which("serve") or serve_cli
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([serve_cli, "run", "--address", "local", self.config_path], cwd=ROOT,
                                         env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve run exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/v1/internal/stats", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise RuntimeError(f"serve run not ready after {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 120.0) -> None:
        """Ctrl-C, as a terminal sends it (SIGINT to the process group); SIGKILL if it does not exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@dataclass
class StreamOutcome:
    """One streaming completion run in a thread."""

    status: int | None = None
    finish_reason: str | None = None
    error_event: dict | None = None
    num_chunks: int = 0
    exception: str | None = None
    first_chunk: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ended_with_error(self) -> bool:
        return self.error_event is not None or self.finish_reason == "error"

    def kind(self) -> str:
        """completed | error_event | finish_error | http_<status> | cut | hung (still running)."""
        if not self.done.is_set():
            return "hung"
        if self.exception is not None:
            return "cut"
        if self.status != 200:
            return f"http_{self.status}"
        if self.error_event is not None:
            return "error_event"
        return "finish_error" if self.finish_reason == "error" else "completed"


def start_stream(url: str, model: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0,
                 n: int = 1) -> StreamOutcome:
    """A streaming completion (`n` choices) run in a thread; the outcome fills in as events arrive."""
    result = StreamOutcome()

    def run() -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "n": n}
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout_s) as r:
                result.status = r.status_code
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        result.error_event = event["error"]
                        continue
                    result.num_chunks += 1
                    result.first_chunk.set()
                    result.finish_reason = event["choices"][0]["finish_reason"] or result.finish_reason
        except Exception as e:  # noqa: BLE001 - recorded
            result.exception = repr(e)
        finally:
            result.first_chunk.set()
            result.done.set()

    threading.Thread(target=run, daemon=True).start()
    return result


def probe(url: str, model: str, timeout_s: float = 60.0) -> tuple[int | str, str | None]:
    """One short non-streaming completion: (HTTP status, or -1 without an answer, or '200-error' for a 200
    whose choice finished with finish_reason 'error'; Retry-After header or the exception)."""
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=timeout_s,
                       json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True})
    except httpx.HTTPError as e:
        return -1, repr(e)
    if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "error":
        return "200-error", None
    return r.status_code, r.headers.get("retry-after")
