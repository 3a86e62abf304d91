"""The engine front's link to its workers: every message in, handled, and every message out (`WorkerLink`, which
`LLMEngine` is built on).

A receiver thread (`_receive_loop`, started by the engine) turns each worker's `StepOutputs` into per-request
outputs (detokenized, stop strings checked, one wake-up per step for each asyncio consumer: `_Deliveries`),
relays prefilled sequences to the decode worker (or, with `handoff: direct`, learns that the prefill worker sent
them itself: aborts then go there) and sends preempted ones back to prefill. The prefill worker's messages are read
before each decode message, so a request's tokens reach the client in order. A worker that goes away, or fails,
makes the engine dead: every running request ends with an error output.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any

from bullet_ray.config import EngineConfig
from bullet_ray.engine.block_allocator import BlockAllocator
from bullet_ray.engine.expiring_ids import ExpiringIds
from bullet_ray.engine.messages import (
    AbortMissed,
    AbortRequests,
    AddRequest,
    Handoff,
    StepOutputs,
    Wake,
    WorkerFailed,
)
from bullet_ray.engine.outputs import FinishReason, RequestOutput
from bullet_ray.engine.request_table import Location, OutputSink, RequestState
from bullet_ray.engine.state_block import Policy, Side, StateBlock
from bullet_ray.policy.ttft import PrefillTimeModel

logger = logging.getLogger(__name__)

# how long an id finished by the front (abort, stop string) stays refused for a new request: a worker drops its
# sequence at its next step (or the front, when a hand-off of it arrives), well within this
RETIRED_ID_HOLD_S = 5.0
# finished ids held at once at most; past it the oldest go, held or not (65,536 in 5 s: ~13k aborts a second)
MAX_RETIRED_IDS = 65536


class WorkerLink:
    """The message side of the engine front; `LLMEngine` sets up the connections, the request table and the state
    block it reads."""

    # set up by LLMEngine
    config: EngineConfig
    state: StateBlock
    allocator: BlockAllocator
    _lock: threading.Lock
    _requests: dict[str, RequestState]
    _conns: dict[str, Connection]
    _send_locks: dict[str, threading.Lock]
    _is_shut_down: bool
    _dead_reason: str | None

    def _init_link(self) -> None:
        # ids finished here (abort, stop string) whose sequence a worker may still hold: their reuse within
        # RETIRED_ID_HOLD_S is refused (a hand-off of the old one would otherwise land in the new request)
        self._retired_ids = ExpiringIds(RETIRED_ID_HOLD_S, MAX_RETIRED_IDS)
        self.num_preemptions = 0  # decode's preemptions relayed through the front
        self._worker_recomputes: dict[str, int] = {}  # role -> its own recomputes so far (StepOutputs)
        # token path measurements: the last worker -> front hops (s); CUDA graphs captured while serving
        self.hop_worker_to_front_s: collections.deque[float] = collections.deque(maxlen=4096)
        # prefill worker's send -> decode worker's take of each hand-off, by either way (config.handoff)
        self.hop_handoff_s: collections.deque[float] = collections.deque(maxlen=4096)
        self._handoffs_undrained: collections.deque[float] = collections.deque(maxlen=4096)  # drain_step_records'
        self.num_direct_handoffs = 0  # prefilled sequences the prefill worker sent to decode itself
        self.num_graph_captures_serving = 0
        # the prefill side's step times -> predicted TTFT (stats); guarded by _lock
        self._prefill_time = PrefillTimeModel(self.config.max_num_batched_tokens)

    def _receive_loop(self) -> None:
        """Every worker's messages, the prefill worker's first: before a decode worker's message it takes every
        prefill message already there, so a request's first token (in the prefill side's message, sent before
        its direct hand-off) is handled before the decode side's next one."""
        conns = {conn: role for role, conn in self._conns.items()}
        prefill = self._conns.get("prefill")
        while not self._is_shut_down:
            try:
                ready = wait(list(conns), timeout=0.5)
            except OSError:
                break
            for conn in ready:
                if conn is prefill:
                    continue  # taken before the decode worker's, or below
                if prefill is not None and not self._take_all(prefill, "prefill"):
                    return
                if not self._take(conn, conns[conn]):  # type: ignore[arg-type,index]
                    return
            if prefill in ready and not self._take_all(prefill, "prefill"):
                return

    def _take_all(self, conn: Connection, role: str) -> bool:
        """Every message waiting on `conn` (False once its worker is gone)."""
        while not self._is_shut_down and conn.poll(0):
            if not self._take(conn, role):
                return False
        return True

    def _take(self, conn: Connection, role: str) -> bool:
        """One message from `role`'s worker, handled (False once that worker is gone)."""
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            if not self._is_shut_down:
                self._mark_dead(f"{role} worker exited")
            return False
        try:
            self._on_message(msg)
            if role != "decode":
                self._observe_prefill_step()
        except Exception:
            logger.exception("engine front failed on %s", type(msg).__name__)
        return True

    def _observe_prefill_step(self) -> None:
        """Feed the prefill side's (or hybrid worker's) last published step to the TTFT model."""
        row = self.state.read(Side.PREFILL if self.config.is_disaggregated else Side.DECODE)
        with self._lock:
            self._prefill_time.observe_step(row["step"], row["num_tokens"], row["step_time_us"] / 1e6)

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            if msg.sent_s:  # the worker -> front hop (same host clock)
                self.hop_worker_to_front_s.append(time.time() - msg.sent_s)
            self.num_graph_captures_serving = max(self.num_graph_captures_serving, msg.num_graph_captures_serving)
            self._worker_recomputes[msg.role] = max(self._worker_recomputes.get(msg.role, 0), msg.num_recomputed)
            self.num_direct_handoffs += len(msg.handed_direct)
            for request_id in msg.handed_direct:  # before the updates: a stop string aborts where the sequence went
                self._on_direct_handoff(request_id)
            if msg.handoff_hops_s:
                self.hop_handoff_s.extend(msg.handoff_hops_s)
                self._handoffs_undrained.extend(msg.handoff_hops_s)
            deliveries = _Deliveries()
            for update in msg.updates():
                self._on_update(update, deliveries)
            deliveries.flush()
            for wire in msg.handoffs:
                self._on_handoff(wire, sent_s=msg.sent_s)
            for wire in msg.prompts_handed_over:
                self._on_handoff(wire, is_prompt=True, sent_s=msg.sent_s)
            for wire in msg.preempted:
                self._on_preempted(wire)
        elif isinstance(msg, WorkerFailed):
            self._mark_dead(f"{msg.role} worker failed:\n{msg.error}")
        elif isinstance(msg, Wake):
            self._send("decode", Wake())  # the prefill worker moved the split; an idle decode side must ack
        elif isinstance(msg, AbortMissed):
            pass  # handed off first: the front dropped its relay (or, direct, aborted it at decode) already
        else:
            logger.warning("unexpected message from a worker: %r", msg)

    def _on_update(self, update: Any, deliveries: _Deliveries | None = None) -> None:
        with self._lock:
            state = self._requests.get(update.request_id)
        if state is None:
            return  # aborted or finished meanwhile
        text, stop_hit = "", False
        if state.detokenizer is not None:
            text, stop_hit = state.detokenizer.step(update.token_ids)
        finish: FinishReason | None = "stop" if stop_hit else update.finish_reason
        stop_reason = state.detokenizer.stop_reason if stop_hit else update.stop_reason
        if finish is not None and state.detokenizer is not None and not stop_hit:
            text += state.detokenizer.finish()
        out = state.make_output(list(update.token_ids), text, update.logprobs, finish, stop_reason)
        if finish is not None:
            finished_here = update.finish_reason is None  # a stop string: the worker still holds the sequence
            with self._lock:
                self._requests.pop(state.request_id, None)
                if finished_here:
                    self._retire(state.request_id)
            if finished_here:
                self._send(state.location, AbortRequests([state.request_id]))
        if deliveries is not None:
            deliveries.add(state.sink, out)
        else:
            state.sink.put(out)

    def _relabel(self, request_id: str, location: Location) -> RequestState | None:
        """The request's state with its worker now `location` (where its aborts go); None once it finished or was
        aborted."""
        with self._lock:
            state = self._requests.get(request_id)
            if state is not None:
                state.location = location
        return state

    def _on_direct_handoff(self, request_id: str) -> None:
        """The prefill worker sent this prefilled sequence to the decode worker itself: aborts go there now. One
        that finished or was aborted meanwhile is aborted at decode (which drops it as it arrives if need be)."""
        if self._relabel(request_id, "decode") is None:
            self._send("decode", AbortRequests([request_id]))

    def _on_handoff(self, wire: Any, is_prompt: bool = False, sent_s: float = 0.0) -> None:
        """Relay a prefilled sequence (or with `is_prompt` a prompt the mixed fallback hands over) to decode;
        `sent_s`: when the prefill worker sent it (the hand-off's hop, timed by the decode worker)."""
        if self._relabel(wire.request_id, "decode") is None:
            self.allocator.free(wire.block_ids)  # finished or aborted while in flight: nobody holds it
            if is_prompt:  # it will never reach decode: the prefill worker must not wait for it
                self.state.count_handed_prompts(Policy.HANDED_PROMPTS_DROPPED)
            return
        self._send_moved("decode", Handoff(wire, is_prompt, sent_s, via="front"), wire.request_id)

    def _on_preempted(self, wire: Any) -> None:
        state = self._relabel(wire.request_id, "prefill")
        self.num_preemptions += 1
        if state is not None:
            self._send_moved("prefill", AddRequest(wire.request_id, wire.prompt_token_ids, state.params,
                                                   wire.arrival_s, wire.max_model_len, resume=wire), wire.request_id)

    def _send_moved(self, role: str, msg: Any, request_id: str) -> None:
        """Send `role`'s worker the message that brings it `request_id` (relabelled there already). An abort
        between the relabel and this send went to `role` ahead of the message and missed: abort again behind it
        (a worker ignores an abort of a request it does not hold)."""
        self._send(role, msg)
        with self._lock:
            aborted = request_id not in self._requests
        if aborted:
            self._send(role, AbortRequests([request_id]))

    def _retire(self, request_id: str) -> None:
        """(Under the lock.) `request_id` finished here while a worker may still hold its sequence."""
        self._retired_ids.add(request_id)

    def _abort_many(self, request_ids: list[str]) -> None:
        """Abort the ids still running: one abort output each, one message per worker that holds any."""
        with self._lock:
            popped = [(rid, self._requests.pop(rid, None)) for rid in request_ids]
            found = [(rid, state) for rid, state in popped if state is not None]
            for rid, _ in found:
                self._retire(rid)
        by_location: dict[str, list[str]] = {}
        for rid, state in found:
            state.sink.put(state.make_output([], "", None, finish_reason="abort"))
            by_location.setdefault(state.location, []).append(rid)
        for location, ids in by_location.items():
            self._send(location, AbortRequests(ids))

    def _send(self, role: str, msg: Any) -> None:
        data = ForkingPickler.dumps(msg)  # what Connection.send writes, pickled before the lock and the write
        is_writing = False
        try:
            with self._send_locks[role]:
                is_writing = True
                self._conns[role].send_bytes(data)
                is_writing = False
        except (OSError, KeyError) as e:
            self._mark_dead(f"cannot reach the {role} worker: {e}")
        except BaseException:
            if is_writing:  # e.g. Ctrl-C inside a long write: the connection may hold part of a message. Closed,
                # the worker reads its end (and exits) instead of taking the next message as this one's rest
                self._conns[role].close()
                self._mark_dead(f"interrupted while sending to the {role} worker")
            raise

    def _mark_dead(self, reason: str) -> None:
        if self._is_shut_down or self._dead_reason is not None:  # the first reason stands
            return
        logger.error("engine is dead: %s", reason)
        self._dead_reason = reason
        self._fail_requests(reason)

    def _fail_requests(self, reason: str) -> int:
        """End every running request with an error output; returns how many there were."""
        with self._lock:
            states = list(self._requests.values())
            self._requests.clear()
        for state in states:
            state.sink.put(state.make_output([], "", None, finish_reason="error", error=reason))
        return len(states)


class _Deliveries:
    """A step's outputs, handed to each asyncio consumer loop in one wake-up (not one per token): a step of
    256 sequences costs the replica's event loop one `call_soon_threadsafe` instead of 256."""

    def __init__(self) -> None:
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]] = {}

    def add(self, sink: OutputSink, output: RequestOutput) -> None:
        if sink.loop is None or sink.async_queue is None:
            sink.put(output)
        else:
            self._by_loop.setdefault(sink.loop, []).append((sink.async_queue, output))

    def flush(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumer's loop is closed: nobody reads these
                pass
        self._by_loop.clear()


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for q, output in items:
        q.put_nowait(output)
