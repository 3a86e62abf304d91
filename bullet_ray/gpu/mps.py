"""The CUDA MPS control daemon of one deployment on one node: start, stop, status, client environment.

Each deployment name gets its own pipe and log folders (<root>/<name>/{pipe,log}, root
/tmp/bullet_ray/mps by default), so two deployments on one host never share a daemon by accident;
there is no fallback to NVIDIA's global /tmp/nvidia-mps. Clients (the prefill and decode workers) need
`MpsDaemon(name).env()` in their environment. Workers that expect MPS call `require_mps(env)`, which
raises MpsNotRunningError naming the pipe folder when no daemon answers there.

    python -m bullet_ray.gpu.mps start|stop|status NAME     (also deploy/mps/{start,stop,status}.sh NAME)
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from bullet_ray.errors import BulletRayError, ConfigError

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
DEFAULT_ROOT = "/tmp/bullet_ray/mps"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class MpsError(BulletRayError, RuntimeError):
    """The daemon could not be started, asked or stopped; the message says which and why."""


class MpsNotRunningError(MpsError):
    """A worker expects MPS but no daemon answers on its pipe folder."""


@dataclass(frozen=True)
class MpsStatus:
    is_running: bool
    pipe_dir: str
    detail: str  # the daemon's answer, or why it is not running
    server_pids: tuple[int, ...] = field(default=())  # MPS servers (one per user with clients)

    @property
    def may_have_clients(self) -> bool:
        """False only when no MPS server runs: every client connects through one. A server may outlive its
        clients (`MpsDaemon.client_pids` tells)."""
        return bool(self.server_pids)


def parse_server_list(text: str) -> tuple[int, ...]:
    """PIDs from the answer to `get_server_list` (one per line; other lines ignored)."""
    return tuple(int(line) for line in (s.strip() for s in text.splitlines()) if line.isdigit())


class MpsDaemon:
    """The daemon of deployment `name` on this node. `control` is the control binary (name on PATH or path)."""

    def __init__(self, name: str, root: str | None = None, control: str = CONTROL) -> None:
        if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
            raise ConfigError("mps_name", f"{name!r} must be 1-64 letters, digits, '_', '.' or '-' "
                              "(it names this deployment's pipe folder)")
        self.name = name
        self.root = root or os.environ.get("BULLET_RAY_MPS_ROOT") or DEFAULT_ROOT
        self.pipe_dir = os.path.join(self.root, name, "pipe")
        self.log_dir = os.path.join(self.root, name, "log")
        self.control = control

    def env(self) -> dict[str, str]:
        """What an MPS client process needs in its environment to reach this daemon."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def command(self, *args: str) -> list[str]:
        """The argv of one control call (the environment comes from env())."""
        exe = shutil.which(self.control)
        if exe is None:
            raise MpsError(f"{self.control} not found on PATH (is the NVIDIA driver installed on this node?)")
        return [exe, *args]

    def _run(self, *args: str, stdin: str | None = None, timeout_s: float = 10) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env()}
        env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)  # the daemon serves every GPU of the node (a CPU-only caller may hide them)
        return subprocess.run(self.command(*args), input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              env=env)

    def _has_pipe(self) -> bool:
        return os.path.exists(os.path.join(self.pipe_dir, "control"))

    def status(self) -> MpsStatus:
        """Running when the control pipe exists and the daemon answers `get_server_list`."""
        if not self._has_pipe():
            return MpsStatus(False, self.pipe_dir, "no control pipe")
        try:
            proc = self._run(stdin="get_server_list\n", timeout_s=5)
        except (MpsError, subprocess.TimeoutExpired) as e:
            return MpsStatus(False, self.pipe_dir, str(e))
        text = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            return MpsStatus(False, self.pipe_dir, text or f"exit status {proc.returncode}")
        return MpsStatus(True, self.pipe_dir, text, parse_server_list(proc.stdout))

    def client_pids(self, server_pid: int) -> tuple[int, ...] | None:
        """The clients of MPS server `server_pid` (`get_client_list <pid>`: one PID per line, nothing when it has
        none); None when the daemon does not answer with PIDs alone (an error, another driver's wording): unknown."""
        try:
            proc = self._run(stdin=f"get_client_list {int(server_pid)}\n", timeout_s=5)
        except (MpsError, subprocess.TimeoutExpired):
            return None
        lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
        if proc.returncode != 0 or not all(line.isdigit() for line in lines):
            return None
        return tuple(int(line) for line in lines)

    def start(self, timeout_s: float = 10) -> MpsStatus:
        """Start the daemon (a no-op when it runs already) and wait until it answers."""
        status = self.status()
        if status.is_running:
            return status
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        proc = self._run("-d")
        if proc.returncode != 0:
            raise MpsError(f"{self.control} -d failed for {self.pipe_dir}: "
                           f"{proc.stderr.strip() or proc.stdout.strip() or proc.returncode}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if status.is_running:
                logger.info("MPS daemon %s started on %s", self.name, self.pipe_dir)
                return status
            time.sleep(0.05)
        raise MpsError(f"the MPS daemon did not answer on {self.pipe_dir} within {timeout_s} s "
                       f"(see {self.log_dir}/control.log)")

    def stop(self, timeout_s: float = 30) -> bool:
        """Ask the daemon to quit (a no-op when it is not running). False if it did not quit in time."""
        if not self.status().is_running:
            return True
        try:
            self._run(stdin="quit\n", timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the MPS daemon on %s did not quit within %.0f s", self.pipe_dir, timeout_s)
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._has_pipe() and self.status().is_running:
            time.sleep(0.05)
        return not self.status().is_running


def require_mps(env: dict[str, str] | None = None) -> str:
    """The pipe folder of the MPS daemon this process (or `env`) would use; MpsNotRunningError if none."""
    env = dict(os.environ if env is None else env)
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY")
    if not pipe:
        raise MpsNotRunningError("CUDA_MPS_PIPE_DIRECTORY is not set: give workers MpsDaemon(name).env() "
                                 "(start the daemon with `bash deploy/mps/start.sh NAME`)")
    if not os.path.exists(os.path.join(pipe, "control")):
        raise MpsNotRunningError(f"no MPS daemon on {pipe}: start one with `bash deploy/mps/start.sh NAME` "
                                 "and give workers its CUDA_MPS_PIPE_DIRECTORY")
    return pipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bullet_ray.gpu.mps",
                                     description="Start, stop or ask the MPS control daemon of one deployment.")
    parser.add_argument("action", choices=["start", "stop", "status", "env"])
    parser.add_argument("name", help="deployment name (its pipe folder is <root>/<name>/pipe)")
    parser.add_argument("--root", default=None, help=f"folder of all deployments' MPS folders (default "
                        f"$BULLET_RAY_MPS_ROOT or {DEFAULT_ROOT})")
    args = parser.parse_args(argv)
    daemon = MpsDaemon(args.name, args.root)
    try:
        if args.action == "env":
            for k, v in daemon.env().items():
                print(f"export {k}={v}")
            return 0
        if args.action == "start":
            status = daemon.start()
        elif args.action == "stop":
            ok = daemon.stop()
            print(f"stopped {daemon.pipe_dir}" if ok else f"daemon on {daemon.pipe_dir} did not quit in time")
            return 0 if ok else 1
        else:
            status = daemon.status()
    except MpsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'running' if status.is_running else 'not running'}: {status.pipe_dir} ({status.detail})")
    return 0 if status.is_running else 1


if __name__ == "__main__":
    sys.exit(main())
