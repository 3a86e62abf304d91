"""The two workers' start-up, overlapped (bullet_ray.engine.startup_order): the front starts the decode worker at the
prefill worker's Handles, before prefill's graph capture; a worker that fails before or after the handles, or
the decode worker failing while prefill still captures, gives the same clear EngineDeadError and leaves no worker,
no watchdog and no runtime folder. Failures are injected in the worker processes by a launcher whose children
patch the worker's code before they run it (CPU: `capture_graphs` stands for the GPU's graph capture)."""

from __future__ import annotations

import os
import time

import pytest

from benchmarks.faults import wait_for
from bullet_ray.config import EngineConfig
from bullet_ray.engine.launcher import ProcessLauncher, WorkerHandle, WorkerSpec, _ProcessHandle
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import EngineDeadError

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _wait_for_file(path: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _run_patched(spec: WorkerSpec, faults: tuple[str, ...], marker: str) -> None:
    """A worker process: the faults ("<role>:<where>") of its role patched into its code, then `run_worker`. Where:
    `resources` (fails creating or attaching the shared memory: before any Handles), `capture` (fails in
    capture_graphs once the decode worker was launched: after prefill's Handles), `slow_capture` (capture_graphs
    takes 60 s), `wait_capture` (capture_graphs waits up to 5 s for the decode worker's launch)."""
    from bullet_ray.engine.worker import entry
    from bullet_ray.engine.worker.main import WorkerBase

    for fault in faults:
        role, where = fault.split(":")
        if spec.role != role:
            continue
        if where == "resources":
            def fail(*args: object) -> None:
                raise RuntimeError(f"injected {spec.role} resources failure")

            entry.create_resources = fail  # type: ignore[assignment]
            entry.attach_resources = fail  # type: ignore[assignment]
        elif where == "capture":
            def fail_capture(self: WorkerBase) -> None:
                assert _wait_for_file(marker, 60.0), "the decode worker was not launched"
                raise RuntimeError(f"injected {spec.role} capture failure")

            WorkerBase.capture_graphs = fail_capture  # type: ignore[method-assign]
        elif where == "slow_capture":
            WorkerBase.capture_graphs = lambda self: time.sleep(60.0)  # type: ignore[method-assign]
        elif where == "wait_capture":
            WorkerBase.capture_graphs = lambda self: _wait_for_file(marker, 5.0)  # type: ignore[method-assign]
    entry.run_worker(spec)


class FaultLauncher(ProcessLauncher):
    """ProcessLauncher whose workers run `_run_patched` with `faults`; writes `marker` when it launches the decode
    worker, and records when it launched each role (time.monotonic())."""

    def __init__(self, marker: str, *faults: str) -> None:
        super().__init__()
        self.faults, self.marker = faults, marker
        self.launched_at: dict[str, float] = {}

    def launch(self, spec: WorkerSpec) -> WorkerHandle:
        process = self._ctx.Process(target=_run_patched, args=(spec, self.faults, self.marker),
                                    name=f"bullet-{spec.role}", daemon=True)
        process.start()
        self.launched_at[spec.role] = time.monotonic()
        if spec.role == "decode":
            open(self.marker, "w").close()
        handle = _ProcessHandle(process)
        self.handles.append(handle)
        return handle


def _config(tmp_path) -> EngineConfig:
    return EngineConfig(model="dummy:tiny-llama", num_kv_blocks=64, block_size=16,
                        runtime_dir=str(tmp_path / "runtime"))


def _watchdogs_of(base: str) -> list[int]:
    """Pids of the processes whose command line names `base` (the engine's watchdog names its folder there)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if base.encode() in f.read():
                        pids.append(int(name))
            except OSError:
                pass
    return pids


def _assert_released(launcher: FaultLauncher, base: str) -> None:
    assert launcher.handles and not any(h.is_alive() for h in launcher.handles)
    assert not [n for n in os.listdir(base) if n.startswith("bullet_ray-")], os.listdir(base)
    assert wait_for(lambda: not _watchdogs_of(base), 30.0, 0.1), _watchdogs_of(base)


@pytest.mark.parametrize("fault,launched", [
    ("prefill:resources", ["prefill"]),  # before its Handles: decode is never launched
    ("prefill:capture", ["prefill", "decode"]),  # after its Handles, decode starting meanwhile
    ("decode:resources", ["prefill", "decode"]),
])
def test_a_worker_failing_at_start_up_is_a_clear_error_and_leaves_nothing(tmp_path, fault, launched):
    role, where = fault.split(":")
    launcher = FaultLauncher(str(tmp_path / "decode-launched"), fault)
    with pytest.raises(EngineDeadError) as error:
        LLMEngine(_config(tmp_path), launcher=launcher)
    assert f"{role} worker failed to start" in str(error.value)
    assert f"injected {role} {where} failure" in str(error.value)
    assert list(launcher.launched_at) == launched
    _assert_released(launcher, str(tmp_path / "runtime"))


def test_a_decode_failure_while_prefill_captures_stops_prefill_too(tmp_path):
    """The front watches both workers while either starts: decode's error is raised without waiting for
    prefill's (60 s) capture, and the shutdown that follows stops prefill in the middle of it."""
    launcher = FaultLauncher(str(tmp_path / "decode-launched"), "prefill:slow_capture", "decode:resources")
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as error:
        LLMEngine(_config(tmp_path), launcher=launcher)
    assert "decode worker failed to start" in str(error.value) and "injected decode" in str(error.value)
    assert time.monotonic() - started < 50.0
    _assert_released(launcher, str(tmp_path / "runtime"))


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_decode_starts_at_prefills_handles_unless_overlap_is_off(tmp_path, monkeypatch, overlap):
    """Overlapped, the decode worker is launched before prefill is ready (prefill's capture waits for that
    launch); with BULLET_RAY_STARTUP_OVERLAP=0 only after. Either way the engine serves (the token checks against
    transformers, with the default overlap, are tests/integration/test_engine.py's)."""
    monkeypatch.setenv("BULLET_RAY_STARTUP_OVERLAP", overlap)
    launcher = FaultLauncher(str(tmp_path / "decode-launched"), "prefill:wait_capture")
    engine = LLMEngine(_config(tmp_path), launcher=launcher)
    try:
        prefill_ready = engine._startup_began + engine.worker_info["prefill"]["ready_after_s"]
        assert (launcher.launched_at["decode"] < prefill_ready) == (overlap == "1")
        assert engine.worker_info["prefill"]["handles_after_s"] > 0
        assert engine.worker_info["decode"]["handles_after_s"] is None
        (output,) = engine.generate([[5, 6, 7, 8]], GREEDY)
        assert len(output.token_ids) == 8
    finally:
        engine.shutdown()
