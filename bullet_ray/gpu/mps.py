"""The CUDA MPS control daemon of one deployment on one node: start, stop, status, client environment.

Each deployment name gets its own pipe and log folders (/tmp/bullet_ray/mps/<name>/{pipe,log}), so two
deployments on one host never share a daemon by accident. Workers that expect MPS call `require_mps`,
which fails with a message naming the pipe folder when the daemon is not running.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

from bullet_ray.errors import BulletRayError, ConfigError

logger = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class MpsError(BulletRayError, RuntimeError):
    """The daemon could not be started or asked."""


class MpsNotRunningError(MpsError):
    """A worker expects MPS but no daemon answers on its pipe folder."""


@dataclass(frozen=True)
class MpsStatus:
    is_running: bool
    pipe_dir: str
    detail: str


class MpsDaemon:
    def __init__(self, name: str, root: str = "/tmp/bullet_ray/mps", control: str = CONTROL) -> None:
        if not _NAME.match(name):
            raise ConfigError("mps_name", f"{name!r} must be 1-64 letters, digits, '_', '.' or '-'")
        self.name = name
        self.pipe_dir = os.path.join(root, name, "pipe")
        self.log_dir = os.path.join(root, name, "log")
        self.control = control

    def env(self) -> dict[str, str]:
        """What an MPS client process needs in its environment."""
        return {"CUDA_MPS_PIPE_DIRECTORY": self.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": self.log_dir}

    def _run(self, *args: str, stdin: str | None = None, timeout_s: float = 10) -> subprocess.CompletedProcess:
        exe = shutil.which(self.control)
        if exe is None:
            raise MpsError(f"{self.control} not found on PATH (is the NVIDIA driver installed?)")
        return subprocess.run([exe, *args], input=stdin, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **self.env()})

    def status(self) -> MpsStatus:
        if not os.path.exists(os.path.join(self.pipe_dir, "control")):
            return MpsStatus(False, self.pipe_dir, "no control pipe")
        try:
            proc = self._run(stdin="get_server_list\n", timeout_s=5)
        except (MpsError, subprocess.TimeoutExpired) as e:
            return MpsStatus(False, self.pipe_dir, str(e))
        return MpsStatus(proc.returncode == 0, self.pipe_dir, (proc.stdout + proc.stderr).strip())

    def start(self, timeout_s: float = 10) -> MpsStatus:
        """Start the daemon (idempotent) and wait until it answers."""
        if self.status().is_running:
            return self.status()
        os.makedirs(self.pipe_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        proc = self._run("-d")
        if proc.returncode != 0:
            raise MpsError(f"{self.control} -d failed: {proc.stderr.strip() or proc.stdout.strip()}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            status = self.status()
            if status.is_running:
                return status
            time.sleep(0.1)
        raise MpsError(f"the MPS daemon did not answer on {self.pipe_dir} within {timeout_s} s")

    def stop(self, timeout_s: float = 30) -> bool:
        """Ask the daemon to quit (a no-op when it is not running); False if it did not answer in time."""
        if not self.status().is_running:
            return True
        try:
            self._run(stdin="quit\n", timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the MPS daemon on %s did not quit within %.0f s", self.pipe_dir, timeout_s)
            return False
        return True


def require_mps(env: dict[str, str] | None = None) -> str:
    """Raise MpsNotRunningError unless an MPS daemon owns the pipe folder this process would use."""
    env = dict(os.environ if env is None else env)
    pipe = env.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
    if not os.path.exists(os.path.join(pipe, "control")):
        raise MpsNotRunningError(f"no MPS daemon on {pipe}: start one with `bash deploy/mps/start.sh <name>` "
                                 "and give workers its CUDA_MPS_PIPE_DIRECTORY")
    return pipe
