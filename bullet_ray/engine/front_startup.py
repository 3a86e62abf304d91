"""The engine front's start-up (`WorkerStartup`, a part of `LLMEngine`): launch the first worker (prefill, or hybrid
for the chunked schedule), which loads the model and creates the shared weights, KV pool and state block; at its
handles launch the decode worker so it maps the same memory, while the first worker captures its CUDA graphs
(bullet_ray.engine.startup_order); ready once both are. Every worker is watched meanwhile: an error it sent, its exit
or its deadline raises EngineDeadError."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener, wait
from typing import Any

from bullet_ray.config import EngineConfig
from bullet_ray.engine.block_allocator import BlockAllocator
from bullet_ray.engine.launcher import WorkerHandle, WorkerLauncher, WorkerRole, WorkerSpec
from bullet_ray.engine.messages import ConnectHandoff, Handles, Ready, WorkerFailed
from bullet_ray.engine.runtime_dir import WORKER_FILE_PREFIX, write_pid_file
from bullet_ray.engine.startup_order import overlaps_startup
from bullet_ray.engine.state_block import StateBlock
from bullet_ray.errors import EngineDeadError


def _prepare_model_in_subprocess(source: str) -> None:
    """Build the embedded model's cache (GGUF dequantization) in a short-lived process, so no long-lived
    process keeps the heap it needed."""
    from bullet_ray.models.loader import EMBEDDED_NAMES, is_embedded_cached

    if source.lower() not in EMBEDDED_NAMES or is_embedded_cached():
        return
    import multiprocessing as mp

    from bullet_ray.models.loader import cache_embedded

    proc = mp.get_context("spawn").Process(target=cache_embedded, name="bullet-prepare-model")
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        cache_embedded()  # raise the real error here


class WorkerStartup:
    """Start-up of the engine front's workers; LLMEngine sets the fields below before `_start_workers`."""

    config: EngineConfig
    launcher: WorkerLauncher
    runtime_dir: str
    state: StateBlock
    allocator: BlockAllocator
    _listener: Listener
    _authkey: bytes
    _conns: dict[str, Connection]
    _send_locks: dict[str, threading.Lock]
    _workers: dict[str, WorkerHandle]
    worker_info: dict[str, dict]
    _startup_began: float
    _startup_timeout_s: float
    _deadlines: dict[str, float]
    _send: Callable[[str, Any], None]  # WorkerLink's

    def _start_workers(self, timeout_s: float) -> None:
        """Launch the first worker; once its shared memory exists (its Handles) the decode worker too, which then
        captures its graphs beside the first one's (or only at the first one's Ready: `overlaps_startup`); the
        engine is ready once every worker is. A worker that fails or exits meanwhile, either one, raises
        EngineDeadError with its error (the caller's shutdown stops the other)."""
        overlap = overlaps_startup(self.config)  # before the model loads: a bad BULLET_RAY_STARTUP_OVERLAP fails now
        _prepare_model_in_subprocess(self.config.model)
        first: WorkerRole = "prefill" if self.config.is_disaggregated else "hybrid"
        self.launcher.prepare(["prefill", "decode"] if self.config.is_disaggregated else ["hybrid"])
        self._startup_began = time.monotonic()
        self._launch(first, None, timeout_s)
        handles = self._await_startup({first: Handles})[first].handles
        self.handles = handles
        self._max_model_len = handles.max_model_len
        self.eos_token_ids = tuple(handles.eos_token_ids)
        self.allocator = BlockAllocator.attach(handles.kv_pool.allocator)
        self.state = StateBlock.attach(handles.state)
        if self.config.is_disaggregated:
            if not overlap:
                self._await_startup({first: Ready})
            self._launch("decode", handles, timeout_s)
        self._await_startup({role: Ready for role in self._conns if role not in self.worker_info})
        if self.config.is_disaggregated:
            address = self.worker_info["decode"].get("handoff_address")
            if address:  # handoff: direct: the prefill worker connects to the decode worker's socket
                self._send("prefill", ConnectHandoff(address))
            if self.config.is_gpu:
                uuids = {self.worker_info[r].get("gpu_uuid") for r in ("prefill", "decode")}
                if len(uuids) != 1:
                    raise EngineDeadError(f"prefill and decode workers landed on different GPUs: {uuids}")
        self.vocab_size = int(handles.model_config.get("vocab_size", 0))
        from bullet_ray.models.loader import load_tokenizer

        self._tokenizer = load_tokenizer(handles.tokenizer_path)

    def _launch(self, role: str, attach: Any, timeout_s: float) -> None:
        """Start a worker and take its connection; its start-up messages are `_await_startup`'s to read."""
        spec = WorkerSpec(role=role, config=self.config, address=self._listener.address,  # type: ignore[arg-type]
                          authkey=self._authkey, attach=attach)
        self._deadlines[role] = time.monotonic() + timeout_s
        handle = self.launcher.launch(spec)
        self._workers[role] = handle
        self._conns[role] = self._accept(handle, role, timeout_s)
        self._send_locks[role] = threading.Lock()

    def _await_startup(self, wanted: dict[str, type]) -> dict[str, Any]:
        """Wait until each worker in `wanted` sent its next start-up message, which must be of the given type
        (Handles, Ready), watching every launched worker meanwhile: a WorkerFailed from any, a worker that exited
        or one past its deadline (`timeout_s` from its launch) raises EngineDeadError. Records each Ready's info."""
        got: dict[str, Any] = {}
        conns: dict[Any, str] = {self._conns[role]: role for role in wanted}
        while len(got) < len(wanted):
            ready = wait(list(conns), 0.2)
            for conn in [c for c in conns if c in ready]:  # in launch order: the first worker's error comes first
                role = conns.pop(conn)
                got[role] = self._startup_message(role, wanted[role])
            for role, handle in self._workers.items():
                if not handle.is_alive():
                    self._raise_failure(role)  # a WorkerFailed it sent before exiting, else that it exited
                    raise EngineDeadError(f"{role} worker exited during start-up")
                if role in conns and time.monotonic() > self._deadlines[role]:
                    raise EngineDeadError(f"{role} worker sent no {wanted[role].__name__} within "
                                          f"{self._startup_timeout_s:.0f} s of its launch")
        return got

    def _startup_message(self, role: str, expected: type) -> Any:
        try:
            msg = self._conns[role].recv()
        except (EOFError, OSError):
            raise EngineDeadError(f"{role} worker exited during start-up") from None
        if isinstance(msg, WorkerFailed):
            raise EngineDeadError(f"{role} worker failed to start:\n{msg.error}")
        if not isinstance(msg, expected):
            raise EngineDeadError(f"{role} worker sent {type(msg).__name__} during start-up, "
                                  f"expected {expected.__name__}")
        pid = msg.pid if isinstance(msg, Handles) else msg.info.get("pid") if isinstance(msg, Ready) else None
        if pid:  # for the watchdog, should this front die first (the creating worker's: already at its Handles)
            write_pid_file(self.runtime_dir, f"{WORKER_FILE_PREFIX}{role}.pid", int(pid))
        if isinstance(msg, Ready):
            self.worker_info[role] = {**msg.info, "ready_after_s": round(time.monotonic() - self._startup_began, 3)}
        return msg

    def _raise_failure(self, role: str) -> None:
        """Raise the error a worker that exited sent first, if it sent one (its last message may be WorkerFailed)."""
        conn = self._conns.get(role)
        try:
            while conn is not None and conn.poll(0):
                msg = conn.recv()
                if isinstance(msg, WorkerFailed):
                    raise EngineDeadError(f"{role} worker failed to start:\n{msg.error}")
        except (EOFError, OSError):
            pass

    def _accept(self, handle: WorkerHandle, role: str, timeout_s: float) -> Connection:
        result: list[Any] = []
        thread = threading.Thread(target=lambda: result.append(self._listener.accept()), daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive() and (not handle.is_alive() or time.monotonic() > deadline):
                raise EngineDeadError(f"{role} worker did not connect (alive={handle.is_alive()})")
        return result[0]
