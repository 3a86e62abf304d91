"""`DecodeWorker`: the bullet schedule's decode side (the package docstring has the KV-progress rules)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

from bullet_ray.engine.messages import Handoff, StepOutputs
from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import ScheduledSeq, is_decode_only, release
from bullet_ray.engine.scheduler.chunked import promote, prompt_chunks
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.state_block import Policy, Side
from bullet_ray.engine.worker.handoff import AbortTombstones, HandoffInbox
from bullet_ray.engine.worker.policy_link import order_by_slack, with_pushed
from bullet_ray.engine.worker.roles.side import SideWorker, admitting_scheduler_args, step_outputs


class DecodeWorker(SideWorker):
    """The decode side. Under overload (`mixed_fallback_tokens`) the prefill worker hands it its queued prompts
    (with what is computed so far): it then runs chunked-prefill steps, its decode rows first and the token
    budget filled with chunks of those prompts in least-slack order, until they are done; the prefill worker
    plans nothing until each has left `prompts` (promoted or aborted: HANDED_PROMPTS_DONE, package docstring)."""

    _old_pieces_entry: int | None = None  # (also for workers built without __init__: the tests' harnesses)

    role = "decode"
    side = Side.DECODE

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = DecodeScheduler(self.allocator, self.config.block_size, self.config.max_num_seqs)
        self.prompts = PrefillScheduler(*admitting_scheduler_args(self))  # prompts handed over (mixed fallback)
        self._num_without_slot = 0  # running sequences the last plan left out (max_num_seqs): a hidden queue
        # preempted sequences (blocks freed) not yet sent back to the front for recompute
        self.preempted: list[Sequence] = []
        # handoff: direct: the prefill worker's own socket to this worker (bullet_ray.engine.worker.handoff)
        direct = self.config.handoff == "direct"
        self.handoff_inbox = HandoffInbox(os.path.dirname(self.spec.address), self.spec.authkey) if direct else None
        # direct: aborts of sequences not (yet) here, whose hand-off is then dropped as it arrives (through the
        # front a hand-off and its abort travel in order on one socket: the front aborts again behind a relay)
        self.tombstones = AbortTombstones() if direct else None
        self._handoff_hops_s: list[float] = []  # prefill's send -> taken here, since this worker's last message
        self._moved_in_step = False  # the decode step in pieces moved to another entry at the boundary before
        self._old_pieces_entry: int | None = None  # a move in the launching step: the entry its earlier pieces ran on

    @property
    def handoff_address(self) -> str | None:
        return self.handoff_inbox.address if self.handoff_inbox is not None else None

    def inbox(self) -> list[Any]:
        return self.handoff_inbox.connections() if self.handoff_inbox is not None else []

    def receive(self, conn: Any) -> Any:
        if conn is self.conn or self.handoff_inbox is None:
            return super().receive(conn)
        return self.handoff_inbox.receive(conn)

    def close(self) -> None:
        if self.handoff_inbox is not None:
            self.handoff_inbox.close()
        super().close()

    def num_recomputed(self) -> int:
        return self.prompts.num_reclaimed  # its preemptions travel to the front as `preempted`

    def handle(self, msg: Any) -> None:
        """A prompt the mixed fallback hands over joins `prompts`; a prefilled sequence joins the running set
        (its one uncomputed token is its sampled one: it may be preempted there, never waits in a queue). One
        whose abort came first is dropped, its blocks freed."""
        if not isinstance(msg, Handoff):
            raise TypeError(f"decode worker got unexpected message {type(msg).__name__}")
        seq = Sequence.from_wire(msg.seq)
        dropped = self.tombstones is not None and self.tombstones.take(seq.request_id)
        if msg.sent_s and not msg.is_prompt:  # a prefilled sequence's hop (not the mixed fallback's prompts)
            hop_s = time.time() - msg.sent_s
            self._handoff_hops_s.append(hop_s)
            self.recorder.log.write("handoff", request_id=seq.request_id, via=msg.via, hop_ms=round(hop_s * 1e3, 3),
                                    num_running=len(self.scheduler), dropped=dropped)
        if dropped:
            release(seq, self.allocator)
            if msg.is_prompt:  # it leaves this side's hands without running (the prefill side may plan again)
                self.res.state.count_handed_prompts(Policy.HANDED_PROMPTS_DONE)
            return
        if msg.is_prompt:
            self.prompts.add(seq)
        else:
            self.scheduler.add(seq)

    def has_work(self) -> bool:
        return len(self.scheduler) > 0 or len(self.prompts) > 0 or self.switch_pending()

    def next_step_is_eager(self) -> bool:
        running = len(self.scheduler)
        if len(self.prompts):
            return self.runs_eagerly(running, max(self.config.mixed_chunk_tokens, running))
        return self.runs_eagerly(running)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            # missing: already finished or preempted (the front handles both)
            seq = self.scheduler.abort(rid)
            if seq is None:
                seq = self.prompts.abort(rid)
                if seq is not None:  # a handed-over prompt leaves this side's hands
                    self.res.state.count_handed_prompts(Policy.HANDED_PROMPTS_DONE)
            if seq is not None:
                seq.finish_reason = "abort"
            elif self.tombstones is not None:  # finished or preempted here already, or (handoff: direct) its
                self.tombstones.add(rid)  # hand-off still on its way: dropped if it arrives

    def plan(self) -> list[ScheduledSeq]:
        batch, preempted = self.scheduler.schedule()
        self.preempted.extend(preempted)
        self._num_without_slot = len(self.scheduler) - len(batch)
        if len(self.prompts):
            cfg = self.config
            if len(self.prompts) > 1:
                self._order_prompts()
            batch = batch + prompt_chunks(self.prompts, len(batch), cfg.mixed_chunk_tokens, cfg.max_num_seqs)
        if not batch and self.inflight is None and self.preempted:
            self.conn.send(StepOutputs(self.role, preempted=self._take_preempted()))
        return self.predicted(batch)

    def _order_prompts(self) -> None:
        """The handed-over prompts in the policy's least-slack order before they are chunked (first come, first
        served made a whole burst wait alike: benchmarks/results/serve_h100_m2n)."""
        targets = with_pushed(self.config.planning_targets(), self.res.state.slo_targets())  # per-token, margin kept
        ordered = order_by_slack(self.prompts.waiting, self.recorder.model, self.partitioner.current.decode_sms,
                                 targets, prefill_order=self.config.prefill_order)
        self.prompts.waiting.clear()
        self.prompts.waiting.extend(ordered)

    def launch(self, batch: list[ScheduledSeq], num_layer_groups: int = 1, between_groups: Any = None,
               move_pending: Any = None, before_forward: Any = None, before_sample: Any = None) -> Any:
        """With `decode_pieces` (and the split moving: split_policy slo) a decode-only step runs in pieces, the split
        followed between them (`_between_pieces`); a step with handed-over prompt chunks runs whole, and so does one
        no decode graph holds on a GPU (eager layer groups wait for the GPU to drain at each boundary). On CPU the
        eager forward runs in layer groups with the same hook (the tests' path). A split requested while a
        decode-only step was planned is followed first (the loop followed the requests before planning; planning
        and preparing a step of a hundred sequences took ~1 ms on the H200 host, `serve_h200_m21/`), the step
        predicted again on the entry it runs on; only where following cannot collect the step in flight (overlap
        mode, or none in flight): a collect here would finish sequences the planned batch still holds, and a
        mixed step's piecewise graphs were judged on the entry it was planned on."""
        self._old_pieces_entry = None
        decode_only = is_decode_only(batch)
        if decode_only:
            self._follow_before_any_piece(batch, "launch")
        cfg = self.config
        if cfg.decode_pieces <= 1 or not cfg.uses_split_policy or not decode_only \
                or (cfg.is_gpu and self.runs_eagerly(len(batch))):  # eagerly, each boundary would drain the GPU
            return super().launch(batch)
        self._moved_in_step = False
        return super().launch(batch, cfg.decode_pieces, self._between_pieces, self._move_pending,
                              functools.partial(self._before_pieces, batch), self._before_sample)

    def _before_pieces(self, batch: list[ScheduledSeq]) -> Any:
        """Once a decode step in pieces has its inputs prepared, before anything of its forward (a graph's set-up, its
        first piece): a split requested since the look at launch (above) is followed here as there, with no piece of
        this step launched yet (overlap mode, or none in flight: the step in flight keeps its entry), and the step is
        predicted again on the new entry. The preparation (~0.5-0.7 ms at 90-100 sequences on the H200 host) and the
        set-up that follows were a stretch without a look (m23's 2.16 ms switch came just after the launch's look).
        Returns the stream the step runs on from here (None: where it was)."""
        return self._launch_here() if self._follow_before_any_piece(batch, "prep") else None

    def _before_sample(self) -> Any:
        """Once a decode step in pieces has its last piece launched, before its sampling launch, and again once its
        logits are launched (the sampling launch took 0.8-1.1 ms of host time at 95-115 sequences on the H200 host,
        m24, where the three slowest 32-piece switches were decided; the last piece's whole wait comes before it):
        a split requested and not yet followed in this step (`_move_pending`) is followed as at a boundary between
        pieces (`_between_pieces`, the switch record's `site` `sample`), the rest of the sampling then launched on the
        new partition's stream after the pieces. Returns that stream (None: nothing requested, the launch goes on). The
        step is then published on its pieces' entry, not the sampling's (`_runs_on_now`): the other side must not
        judge the old entry drained while they may still run there."""
        return self._between_pieces(site="sample") if self._move_pending() else None

    def _follow_before_any_piece(self, batch: list[ScheduledSeq], site: str) -> bool:
        """Follow a split requested while the decode-only `batch` was readied, before any of it is launched (at its
        launch, `site` "launch", and once its inputs are prepared, "prep"); only where following cannot collect the
        step in flight (overlap mode, or none in flight). Having moved, the step is predicted again on the entry it
        runs on. True when it moved."""
        if not (self.switch_pending() and (self.switch.overlap or self.inflight is None)):
            return False
        before = self.partitioner.current_index
        self.follow_split(site=site)
        if self.partitioner.current_index == before:
            return False
        self.predicted(batch)
        return True

    def _launch_here(self) -> Any:
        """The stream the rest of a launching step goes on (the partition this side is on now), with the runner's
        graph key and the last stream following it."""
        stream = self.partitioner.current_stream(self.partitioner.side)
        self.runner.graph_key = self.partitioner.current_index
        self._last_stream = stream
        return stream

    def _move_pending(self) -> bool:
        """Polled while the host waits for a piece (DecodeGraphs._run_pieces): a split this side has not followed,
        and no move earlier in this step whose old pieces the next boundary must see finish first."""
        return not self._moved_in_step and self.switch_pending()

    def _between_pieces(self, site: str = "piece") -> Any:
        """A boundary inside a decode step in pieces (the piece before the last launched one has finished, or a
        split was requested while the host waited for it: `_move_pending`): a requested split is followed first, so
        the ack does not wait for the collect below and its outputs (~0.25 ms on the H200 host: the m22 switches
        over 1 ms were acked that long after a collect here); then the step before is learned if it has finished (it
        ran before this step's first piece), so its tokens need not wait for this whole step and the host never
        blocks with one piece queued. Returns the stream the next pieces launch on. The entry this side publishes
        for its step in flight moves one boundary after a move, once the last piece launched on the old entry has
        finished; once the step before has finished this step is the oldest in flight, published on the entry of its
        last launched piece before the follow (whose ack may judge the drain) and kept through the collect."""
        before = self.partitioner.current_index  # where the pieces launched so far ran (the last one: here)
        prev = self.inflight
        prev_done = prev is not None and (prev.done is None or prev.done.query())  # without a wait: pieces stay queued
        if prev_done:  # the oldest step still running is this one, on `before`: published before the follow, whose
            self.res.state.set_inflight_index(self.side, before)  # ack may judge the drain (else: the step before's)
        self.follow_split(site=site)
        moved = self.partitioner.current_index != before
        if prev_done:
            self._finish_inflight()  # inside the launch: the collect leaves this step published (SideWorker.collect)
        if self._moved_in_step:  # the pieces on the entry before `before` have finished: the drain may be complete
            self.res.state.set_inflight_index(self.side, before)
            self._note_drain()
            self._old_pieces_entry = None
        if moved:  # until a later boundary sees them finish, this step holds SMs on `before` too
            self._old_pieces_entry = before
        self._moved_in_step = moved
        return self._launch_here()

    def _runs_on_now(self) -> int:
        """The entry a launched step is published on: after a move that no later boundary saw the old pieces finish
        behind (a move at the last boundary, or before the sampling launch), the entry those pieces ran on, where the
        step holds SMs until it ends; else where this side is (SideWorker's)."""
        if self._old_pieces_entry is not None:
            return self._old_pieces_entry
        return super()._runs_on_now()

    def after_launch(self, step: Any) -> None:
        super().after_launch(step)  # published on `_runs_on_now`
        self._old_pieces_entry = None
        if len(self.prompts):
            promoted = promote(self.prompts, self.scheduler, step.sampled)  # prompts done: decode from the next step
            self.res.state.count_handed_prompts(Policy.HANDED_PROMPTS_DONE, len(promoted))

    def _take_preempted(self) -> list[Any]:
        """Wires of the preempted sequences whose last token the host knows (the rest wait a step)."""
        ready = [s for s in self.preempted if s.num_pending_tokens == 0]
        self.preempted = [s for s in self.preempted if s.num_pending_tokens > 0]
        return [s.to_wire() for s in ready if s.finish_reason is None]

    def process(self, result: StepResult, step: Any, started_s: float) -> None:
        msg, finished = step_outputs(self, result)
        for seq in finished:
            self.scheduler.remove(seq)
        # queued here: prompts handed over (mixed fallback) and prefilled sequences waiting for a decode slot
        self.publish_step(step, started_s, result, len(self.prompts) + self._num_without_slot,
                          sum(s.num_uncomputed_tokens for s in self.prompts.waiting))
        hops, self._handoff_hops_s = self._handoff_hops_s, []
        self.conn.send(dataclasses.replace(msg, preempted=self._take_preempted(), handoff_hops_s=hops))
