"""How the engine starts its worker processes: an interface, and the plain-process implementation.

The engine front (tokenizer, request table, streams) never runs model code. It listens on a Unix socket
and asks a `WorkerLauncher` to start each worker with a `WorkerSpec`; the worker connects back to that
socket and runs `bullet_ray.engine.worker.run_worker(spec)` until told to stop. Standalone engines use
`ProcessLauncher` (multiprocessing, spawn); the Ray Serve layer launches the same function inside Ray
actors (`bullet_ray.serve.workers`), so the engine code is identical in both.
"""

from __future__ import annotations

import abc
import multiprocessing as mp

from bullet_ray.engine.messages import WorkerRole, WorkerSpec

__all__ = ["ProcessLauncher", "WorkerHandle", "WorkerLauncher", "WorkerRole", "WorkerSpec"]


class WorkerHandle(abc.ABC):
    """A started worker, as seen by the engine front."""

    @abc.abstractmethod
    def is_alive(self) -> bool:
        """False once the worker exited or crashed."""

    @abc.abstractmethod
    def kill(self) -> None:
        """Stop the worker now (after a graceful Shutdown message was sent or timed out)."""

    def join(self, timeout_s: float) -> None:  # noqa: B027 - optional
        """Wait up to timeout_s for the worker to exit."""


class WorkerLauncher(abc.ABC):
    """Starts workers. Implementations: ProcessLauncher here, RayActorLauncher in bullet_ray.serve."""

    @abc.abstractmethod
    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        """Start a worker that runs `run_worker(spec)`. Must not block on the worker's start-up."""

    def prepare(self, roles: list[WorkerRole]) -> None:  # noqa: B027 - optional
        """Called once before the first `launch` with every role the engine will launch: a launcher may
        start their processes now, in parallel (the second worker needs the first one's handles, so its
        `launch` comes only once the first has sent them: bullet_ray.engine.startup_order). Must not block."""

    def close(self) -> None:  # noqa: B027 - optional
        """Called by the engine's shutdown after its workers stopped: release what `prepare` started."""


class _ProcessHandle(WorkerHandle):
    def __init__(self, process: mp.process.BaseProcess) -> None:
        self.process = process

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)

    @property
    def pid(self) -> int | None:
        return self.process.pid


def _process_main(spec: WorkerSpec) -> None:
    from bullet_ray.engine.worker import run_worker

    run_worker(spec)


class ProcessLauncher(WorkerLauncher):
    """Starts each worker as a spawned child process of the engine front."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self.handles: list[_ProcessHandle] = []

    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        process = self._ctx.Process(target=_process_main, args=(spec,), name=f"bullet-{spec.role}",
                                    daemon=True)
        process.start()
        handle = _ProcessHandle(process)
        self.handles.append(handle)
        return handle
