"""The prefill worker's `wait_to_plan` (prefill_plan_lead_ms): it takes messages until the step in flight
ends or is `lead` from its predicted end, and does nothing without the setting, a step in flight, or a GPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

from bullet_ray.engine.worker.roles import PrefillWorker


class _Event:
    def __init__(self, done_after_s: float | None = None) -> None:
        self._at = None if done_after_s is None else time.perf_counter() + done_after_s

    def query(self) -> bool:
        return self._at is not None and time.perf_counter() >= self._at


class _Conn:
    def __init__(self, messages: list[str]) -> None:
        self.messages, self.polls = list(messages), 0

    def poll(self, timeout: float) -> bool:
        self.polls += 1
        if self.messages:
            return True
        time.sleep(timeout)
        return False

    def recv(self) -> str:
        return self.messages.pop(0)


def _worker(lead_ms: float | None, predicted_s: float, done: _Event | None, messages: list[str]):
    worker = PrefillWorker.__new__(PrefillWorker)  # only what wait_to_plan reads
    worker.config = SimpleNamespace(prefill_plan_lead_ms=lead_ms)
    now = time.perf_counter()
    worker.inflight = SimpleNamespace(done=done, launched_s=now, perf_record=(None, predicted_s, False))
    worker._last_done_s = now - 0.001  # the step before was collected just before this one's launch
    worker.is_stopped = False
    worker.conn = _Conn(messages)
    got: list[str] = []
    worker.dispatch = got.append  # type: ignore[method-assign]
    return worker, got


def test_waits_until_lead_before_the_predicted_end_taking_messages():
    worker, got = _worker(lead_ms=20.0, predicted_s=0.08, done=_Event(), messages=["add-1", "add-2"])
    start = time.perf_counter()
    worker.wait_to_plan()
    waited = time.perf_counter() - start
    assert got == ["add-1", "add-2"]  # arrivals meanwhile join the next plan
    assert 0.045 <= waited < 0.2  # ~60 ms: predicted 80 ms, planned 20 ms before the end


def test_plans_at_once_after_a_layer_wise_step():
    """A layer-wise step's groups ran before its launch returned: its whole predicted time from the launch would
    put the plan past its end, so the worker plans at once (as without a lead)."""
    worker, got = _worker(lead_ms=10.0, predicted_s=10.0, done=_Event(), messages=["add-1"])
    worker.inflight.num_layer_groups = 4
    start = time.perf_counter()
    worker.wait_to_plan()
    assert time.perf_counter() - start < 0.05 and got == [] and worker.conn.polls == 0


def test_returns_once_the_step_in_flight_has_ended():
    worker, got = _worker(lead_ms=0.0, predicted_s=10.0, done=_Event(done_after_s=0.01), messages=[])
    start = time.perf_counter()
    worker.wait_to_plan()
    assert time.perf_counter() - start < 0.5 and got == []


def test_no_wait_without_the_setting_a_step_in_flight_or_a_gpu():
    for lead, done in ((None, _Event()), (20.0, None)):  # off; on CPU (no event: the step is computed)
        worker, got = _worker(lead_ms=lead, predicted_s=10.0, done=done, messages=["add"])
        worker.wait_to_plan()
        assert worker.conn.polls == 0 and got == []
    worker, got = _worker(lead_ms=20.0, predicted_s=10.0, done=_Event(), messages=["add"])
    worker.inflight = None
    worker.wait_to_plan()
    assert worker.conn.polls == 0


def test_config_bounds_name_the_field():
    import pytest

    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    assert EngineConfig().prefill_plan_lead_ms == 10.0 and EngineConfig(prefill_plan_lead_ms=0).prefill_plan_lead_ms == 0
    assert EngineConfig(prefill_plan_lead_ms=None).prefill_plan_lead_ms is None  # plan at once
    assert EngineArgs().to_engine_config().prefill_plan_lead_ms == 10.0  # the serve config's default too
    with pytest.raises(ConfigError, match="prefill_plan_lead_ms"):
        EngineConfig(prefill_plan_lead_ms=-1.0)
    assert EngineArgs(prefill_plan_lead_ms=15).to_engine_config().prefill_plan_lead_ms == 15
