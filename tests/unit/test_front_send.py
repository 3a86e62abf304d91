"""The engine front's sends and aborts without worker processes: one abort message per worker, and a send
interrupted inside its write (the connection may hold part of a message) marks the engine dead and closes it."""

from __future__ import annotations

import threading
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from bullet_ray.engine.expiring_ids import ExpiringIds
from bullet_ray.engine.front_link import MAX_RETIRED_IDS, RETIRED_ID_HOLD_S
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.messages import AbortRequests


def _front() -> LLMEngine:
    front = LLMEngine.__new__(LLMEngine)  # only what _abort_many, _send and _mark_dead read
    front._lock, front._is_shut_down, front._dead_reason = threading.Lock(), False, None
    front._retired_ids = ExpiringIds(RETIRED_ID_HOLD_S, MAX_RETIRED_IDS)
    front._requests, front._conns, front._send_locks = {}, {}, {}
    return front


def _state(location: str, outputs: list) -> SimpleNamespace:
    return SimpleNamespace(location=location, sink=SimpleNamespace(put=outputs.append),
                           make_output=lambda *a, **k: k.get("finish_reason"))


def test_aborts_go_in_one_message_per_worker_that_holds_any():
    front, outputs, sent = _front(), [], []
    front._requests = {"a": _state("prefill", outputs), "b": _state("decode", outputs), "c": _state("prefill", outputs)}
    front._send = lambda role, msg: sent.append((role, msg))
    front._abort_many(["a", "b", "c", "gone"])
    assert sorted(sent, key=lambda x: x[0]) == [("decode", AbortRequests(["b"])), ("prefill", AbortRequests(["a", "c"]))]
    assert outputs == ["abort"] * 3 and not front._requests and set(front._retired_ids) == {"a", "b", "c"}
    front.abort("a")  # already gone: nothing more
    assert len(sent) == 2


class _Conn:
    def __init__(self, error: BaseException | None) -> None:
        self.error, self.closed, self.data = error, False, []

    def send_bytes(self, data: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.data.append(data)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize(("error", "raises", "dead", "closed"), [
    (None, False, False, False),
    (BrokenPipeError("gone"), False, True, False),  # the worker is gone: dead, the caller goes on
    (KeyboardInterrupt(), True, True, True),  # inside the write: dead, the connection closed, the interrupt goes on
])
def test_a_send_interrupted_inside_its_write_marks_the_engine_dead(error, raises, dead, closed):
    front, outputs = _front(), []
    front._requests = {"a": _state("prefill", outputs)}
    front._conns["prefill"], front._send_locks["prefill"] = _Conn(error), threading.Lock()
    if raises:
        with pytest.raises(type(error)):
            front._send("prefill", AbortRequests(["x"]))
    else:
        front._send("prefill", AbortRequests(["x"]))
    assert (front._dead_reason is not None, front._conns["prefill"].closed) == (dead, closed)
    assert outputs == (["error"] if dead else []) and bool(front._requests) != dead
    first = front._dead_reason
    front._mark_dead("another reason")  # the first reason stands
    assert front._dead_reason == first or not dead


def test_what_the_front_writes_is_what_the_worker_reads():
    reader, writer = Pipe(duplex=False)
    front = _front()
    front._conns["prefill"], front._send_locks["prefill"] = writer, threading.Lock()
    front._send("prefill", AbortRequests(["a", "b"]))
    assert reader.recv() == AbortRequests(["a", "b"])
