"""An engine without Ray (worker child processes) releases its runtime folder and workers on every exit:
shutdown with requests in flight (they end with an error output), a worker killed (the engine is dead,
its requests end with an error), and the front itself killed with SIGKILL (the watchdog cleans up)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from benchmarks.faults import wait_for
from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.runtime_dir import ProcessRef, worker_refs
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import EngineDeadError

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LONG = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)


def _config(tmp_path) -> EngineConfig:
    return EngineConfig(model="dummy:tiny-llama", num_kv_blocks=512, block_size=16, runtime_dir=str(tmp_path))


def _first_token(stream) -> None:
    out = next(stream)
    assert out.finish_reason is None


def test_shutdown_ends_running_requests_with_an_error_and_releases_everything(tmp_path):
    engine = LLMEngine(_config(tmp_path))
    folder, workers = engine.runtime_dir, worker_refs(engine.runtime_dir)
    assert set(workers) == {"prefill", "decode"}
    streams = [engine.stream([5, 6, 7, i], LONG) for i in range(3)]
    for s in streams:
        _first_token(s)
    engine.shutdown(drain_timeout_s=0.2)  # far too short for 1,000 tokens: they are cut
    for s in streams:
        last = list(s)[-1]
        assert last.finish_reason == "error" and "shutting down" in (last.error or "")
    assert not os.path.exists(folder)
    assert not any(ref.is_running() for ref in workers.values())
    with pytest.raises(EngineDeadError):
        engine.check_health()


def test_shutdown_lets_requests_finish_within_the_drain_timeout(tmp_path):
    engine = LLMEngine(_config(tmp_path))
    folder = engine.runtime_dir
    stream = engine.stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    _first_token(stream)
    engine.shutdown(drain_timeout_s=60)  # returns as soon as the request finished
    outs = list(stream)
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 30
    assert not os.path.exists(folder)


def test_a_killed_worker_fails_running_requests_and_shutdown_still_cleans_up(tmp_path):
    engine = LLMEngine(_config(tmp_path))
    folder, workers = engine.runtime_dir, worker_refs(engine.runtime_dir)
    stream = engine.stream([5, 6, 7], LONG)
    _first_token(stream)
    os.kill(workers["decode"].pid, signal.SIGKILL)
    last = list(stream)[-1]
    assert last.finish_reason == "error"
    with pytest.raises(EngineDeadError):
        engine.check_health()
    engine.shutdown()
    assert not os.path.exists(folder)
    assert not any(ref.is_running() for ref in workers.values())


def test_a_front_killed_with_sigkill_leaves_no_folder_and_no_worker(tmp_path):
    code = ("import sys, time; from bullet_ray.config import EngineConfig; "
            "from bullet_ray.engine.llm_engine import LLMEngine; "
            f"e = LLMEngine(EngineConfig(model='dummy:tiny-llama', num_kv_blocks=64, runtime_dir={str(tmp_path)!r})); "
            "print(e.runtime_dir, flush=True); time.sleep(300)")
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert front.stdout is not None
    folder = front.stdout.readline().strip()
    assert folder and os.path.isdir(folder)
    workers: dict[str, ProcessRef] = worker_refs(folder)
    assert set(workers) == {"prefill", "decode"}
    front.kill()
    front.wait()
    assert wait_for(lambda: not os.path.exists(folder), 30.0, 0.05), os.listdir(folder)
    assert wait_for(lambda: not any(ref.is_running() for ref in workers.values()), 30.0, 0.05)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_killed_worker_with_the_direct_hand_off_fails_requests_and_cleans_up(tmp_path, role):
    """With `handoff: direct` the workers hold a socket of their own besides the front's (a failed direct send
    falling back to the front is tests/unit/test_handoff.py's): a killed worker of either side still makes the engine
    dead, its requests end with an error, and shutdown leaves no folder and no worker, the surviving worker
    included (a killed prefill worker closes the decode worker's end of their socket)."""
    config = EngineConfig(model="dummy:tiny-llama", num_kv_blocks=512, block_size=16, runtime_dir=str(tmp_path),
                          handoff="direct")
    engine = LLMEngine(config)
    folder, workers = engine.runtime_dir, worker_refs(engine.runtime_dir)
    stream = engine.stream([5, 6, 7], LONG)
    _first_token(stream)
    assert engine.num_direct_handoffs == 1
    os.kill(workers[role].pid, signal.SIGKILL)
    assert list(stream)[-1].finish_reason == "error"
    with pytest.raises(EngineDeadError):
        engine.check_health()
    engine.shutdown()
    assert not os.path.exists(folder)
    assert not any(ref.is_running() for ref in workers.values())
