"""The engine's runtime folder (socket, shared weights, KV pool, state block) and who removes it.

Every engine front makes one `bullet_ray-*` folder, under /dev/shm when it is writable (the shared
memory lives there) or under `EngineConfig.runtime_dir`. It holds pid files: `owner.pid` (the front)
and `worker-<role>.pid` (each worker, written by the front once the worker is ready), each as
"<pid> <start time>" so a recycled pid is never mistaken for the process that wrote it.

Who removes the folder, on every exit path:
- the front's `LLMEngine.shutdown()` (normal stop, Serve's replica destructor, an engine that failed);
- a watchdog process the front starts beside itself (`python -m bullet_ray.engine.runtime_dir <folder>`,
  in a session of its own so Ctrl-C and process-group kills do not reach it, and reparented to init so
  Ray's clean-up of an exiting worker's children does not either): once the front is gone
  (SIGKILL, a Serve replica killed at the end of its shutdown grace, a Ray cluster torn down), it gives
  the workers a few seconds to notice and exit, kills the ones still running, removes the folder and
  exits. It also exits as soon as the folder is gone (the front cleaned up itself);
- `sweep_orphans`, run when a later engine starts: the last resort if even the watchdog was killed.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PREFIX = "bullet_ray-"
OWNER_FILE = "owner.pid"  # the engine front
WORKER_FILE_PREFIX = "worker-"  # worker-<role>.pid
WATCH_POLL_S = 0.5
WORKER_EXIT_GRACE_S = 5.0  # how long workers get to exit by themselves once the front is gone


@dataclass(frozen=True)
class ProcessRef:
    """A process by pid and start time (clock ticks since boot; None where /proc is not available)."""

    pid: int
    start_ticks: int | None = None

    @classmethod
    def of(cls, pid: int) -> ProcessRef:
        return cls(pid, process_start_ticks(pid))

    def is_running(self) -> bool:
        """Alive and the same process (a recycled pid with another start time is not)."""
        if not _pid_exists(self.pid):
            return False
        if self.start_ticks is None:
            return True
        ticks = process_start_ticks(self.pid)
        return ticks is None or ticks == self.start_ticks

    def dump(self) -> str:
        return f"{self.pid} {self.start_ticks}" if self.start_ticks is not None else str(self.pid)

    @classmethod
    def parse(cls, text: str) -> ProcessRef:
        """'<pid>' or '<pid> <start ticks>'; ValueError on anything else."""
        parts = text.split()
        if not 1 <= len(parts) <= 2:
            raise ValueError(f"not a pid file: {text!r}")
        return cls(int(parts[0]), int(parts[1]) if len(parts) == 2 else None)


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (start time); None when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat[stat.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:  # a zombie (exited, not yet reaped) holds no memory: count it as gone
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def default_base(configured: str | None = None) -> str:
    """Where runtime folders go: the configured folder, else /dev/shm when writable, else the temp dir."""
    if configured:
        os.makedirs(configured, exist_ok=True)
        return configured
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


def create_runtime_dir(configured: str | None = None) -> str:
    """A fresh `bullet_ray-*` folder owned by this process; orphans of dead fronts are swept first."""
    base = default_base(configured)
    sweep_orphans(base)
    path = tempfile.mkdtemp(prefix=PREFIX, dir=base)
    write_pid_file(path, OWNER_FILE, os.getpid())
    return path


def write_pid_file(folder: str, name: str, pid: int) -> None:
    tmp = os.path.join(folder, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(ProcessRef.of(pid).dump())
    os.replace(tmp, os.path.join(folder, name))  # readers never see half a file


def read_pid_file(path: str) -> ProcessRef | None:
    try:
        with open(path) as f:
            return ProcessRef.parse(f.read())
    except (OSError, ValueError):
        return None


def worker_refs(folder: str) -> dict[str, ProcessRef]:
    """role -> worker process, from the folder's worker-<role>.pid files."""
    refs: dict[str, ProcessRef] = {}
    try:
        names = os.listdir(folder)
    except OSError:
        return refs
    for name in names:
        if name.startswith(WORKER_FILE_PREFIX) and name.endswith(".pid"):
            ref = read_pid_file(os.path.join(folder, name))
            if ref is not None:
                refs[name[len(WORKER_FILE_PREFIX):-len(".pid")]] = ref
    return refs


@dataclass(frozen=True)
class EngineFolder:
    """One engine as its runtime folder describes it: the front and the workers that registered."""

    path: str
    front: ProcessRef
    workers: dict[str, ProcessRef]

    def is_gone(self) -> bool:
        """The folder is removed and none of the engine's processes runs."""
        return not os.path.exists(self.path) and not self.front.is_running() and \
            not any(w.is_running() for w in self.workers.values())


def list_engines(base: str | None = None) -> list[EngineFolder]:
    """The engines with a runtime folder under `base` (default: where new engines put theirs)."""
    base = base or default_base()
    found: list[EngineFolder] = []
    try:
        names = sorted(n for n in os.listdir(base) if n.startswith(PREFIX))
    except OSError:
        return found
    for name in names:
        path = os.path.join(base, name)
        front = read_pid_file(os.path.join(path, OWNER_FILE))
        if front is not None:
            found.append(EngineFolder(path, front, worker_refs(path)))
    return found


def sweep_orphans(base: str) -> list[str]:
    """Remove bullet_ray-* folders under `base` whose front no longer runs (and kill their workers)."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        path = os.path.join(base, name)
        owner = read_pid_file(os.path.join(path, OWNER_FILE))
        if owner is None:
            continue  # not ours to judge (no owner file: older, foreign, or still being created)
        if owner.pid == os.getpid() or owner.is_running():
            continue
        release(path, grace_s=0.0)
        removed.append(path)
        logger.warning("removed %s, left by engine process %d which no longer runs", path, owner.pid)
    return removed


def release(folder: str, grace_s: float = WORKER_EXIT_GRACE_S, poll_s: float = 0.1) -> list[str]:
    """Wait up to grace_s for the folder's workers to exit, kill the rest, remove the folder. Returns the
    roles that had to be killed."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(r.is_running() for r in worker_refs(folder).values()):
        time.sleep(poll_s)
    killed = []
    for role, ref in worker_refs(folder).items():
        if ref.is_running():
            try:
                os.kill(ref.pid, signal.SIGKILL)
                killed.append(role)
            except OSError:
                pass
    shutil.rmtree(folder, ignore_errors=True)
    return killed


def watch(folder: str, poll_s: float = WATCH_POLL_S, grace_s: float = WORKER_EXIT_GRACE_S) -> str:
    """The watchdog loop. Returns why it stopped: 'removed' (the front cleaned up) or 'released'."""
    owner = read_pid_file(os.path.join(folder, OWNER_FILE))
    while True:
        if not os.path.isdir(folder):
            return "removed"
        if owner is None or not owner.is_running():
            killed = release(folder, grace_s)
            logger.warning("engine front %s is gone: removed %s%s", owner, folder,
                           f", killed workers {killed}" if killed else "")
            return "released"
        time.sleep(poll_s)


def start_watchdog(folder: str) -> int:
    """Start the watchdog of `folder` (see the module docstring); returns its pid.

    It is detached twice: a session of its own (Ctrl-C of the terminal does not reach it) and not a child
    of this process (an intermediate process forks it and exits), because Ray kills the direct children of a
    worker process that exits, which is how Serve stops a replica whose drain grace ran out."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": package_root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    starter = subprocess.Popen([sys.executable, "-m", "bullet_ray.engine.runtime_dir", "--detach", folder],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=None,
                               start_new_session=True, close_fds=True, env=env, text=True)
    out, _ = starter.communicate(timeout=60)
    if starter.returncode != 0 or not out.strip().isdigit():
        raise RuntimeError(f"the runtime folder's watchdog did not start (exit {starter.returncode}: {out!r})")
    return int(out.strip())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    detach = bool(args) and args[0] == "--detach"
    if detach:
        args = args[1:]
    if len(args) != 1:
        print("usage: python -m bullet_ray.engine.runtime_dir [--detach] <runtime folder>", file=sys.stderr)
        return 2
    if detach:
        pid = os.fork()
        if pid:  # the intermediate: tell the starter who watches, and exit (the watchdog goes to init)
            print(pid, flush=True)
            return 0
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the starter reads our stdout to its end: let go of it
        os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # outlive a Ctrl-C of the terminal that started the engine
    logging.basicConfig(level=logging.WARNING, format="bullet_ray watchdog: %(message)s")
    watch(args[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
