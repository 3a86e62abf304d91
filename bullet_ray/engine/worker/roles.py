"""The three worker roles: prefill (bullet), decode (bullet), hybrid (chunked baseline).

Each role plans its batches and turns collected steps into messages; `WorkerBase.step` launches and
collects them (asynchronously when the config says so: the host learns a step's tokens one step late).

Progress on a full KV pool (bullet). Blocks are held by the decode worker's running sequences (they grow, or
the youngest is preempted to the prefill queue's front with its blocks freed: they never wait), by steps in
flight and sequences in transit (they soon free or pass them on), and by prompts prefilled part-way, which
hold theirs while they wait for their next chunk. A queue of such prompts moves once every block in use is
its own (`PrefillScheduler`: its head takes the watermark and the KV of prompts behind it). Under the mixed
fallback there are two such queues, the prefill worker's and the decode worker's handed-over `prompts`, and
each could hold a prompt part-way and wait for the other's blocks forever. So at most one of them may: the
prefill worker plans nothing while the decode worker still holds (or is being sent) prompts the fallback
handed it (`StateBlock.num_handed_prompts_held`, exact from the prefill side's view or above the truth, never
below). A hand-over empties the prefill queue, and the prefill queue takes blocks only while that count is 0,
so whenever the decode side's `prompts` hold blocks the prefill queue holds none, and the one queue that
holds part-way prompts moves by its own rule. The decode side's `prompts` take only those hand-overs;
prefilled sequences join its running set.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from bullet_ray.engine.layerwise import LayerGroups
from bullet_ray.engine.messages import AbortMissed, AddRequest, ConnectHandoff, Handoff, StepOutputs
from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import ScheduledSeq, release
from bullet_ray.engine.scheduler.chunked import ChunkedScheduler, promote, prompt_chunks
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.state_block import Policy, Side
from bullet_ray.engine.worker.handoff import AbortTombstones, HandoffInbox, HandoffOutbox
from bullet_ray.engine.worker.main import WorkerBase
from bullet_ray.engine.worker.policy_link import (
    FirstTokenLog,
    SplitDecider,
    StepLog,
    StepRecorder,
    is_policy_on,
    make_perf_model,
    order_by_slack,
    with_pushed,
)

# how often the prefill worker's `wait_to_plan` looks at the step in flight while no message comes
PLAN_WAIT_POLL_S = 0.001


def sequence_from_request(msg: AddRequest) -> Sequence:
    """A new sequence, or a preempted one coming back for recompute (blocks freed, nothing computed)."""
    if msg.resume is not None:
        seq = Sequence.from_wire(msg.resume)
        seq.block_ids, seq.num_computed_tokens = [], 0
        return seq
    from bullet_ray.engine.sampler import SamplingState

    sampling = SamplingState(msg.params, list(msg.prompt_token_ids))
    return Sequence(msg.request_id, list(msg.prompt_token_ids), sampling, msg.arrival_s, msg.max_model_len)


def admitting_scheduler_args(worker: WorkerBase) -> tuple[Any, ...]:
    """The arguments of a scheduler that admits new prompts (prefill, chunked): allocator, block size,
    token budget, batch size, and the free blocks it leaves for running sequences to grow into."""
    cfg = worker.config
    return (worker.allocator, cfg.block_size, cfg.max_num_batched_tokens, cfg.max_num_seqs,
            int(cfg.kv_watermark * worker.allocator.num_blocks))


def expect_add_request(worker: WorkerBase, msg: Any) -> AddRequest:
    """The message of a worker that takes new requests (prefill, hybrid); anything else is a bug."""
    if not isinstance(msg, AddRequest):
        raise TypeError(f"{worker.role} worker got unexpected message {type(msg).__name__}")
    return msg


def step_outputs(worker: WorkerBase, result: StepResult) -> tuple[StepOutputs, list[Sequence]]:
    """The step's message (one token per sampled sequence, as arrays) and the sequences it finished."""
    request_ids, token_ids, finished = [], [], []
    done: dict[int, tuple[Any, int | None]] = {}
    logprobs = {}
    for i, seq in enumerate(result.sampled):
        token = seq.output_token_ids[-1]
        request_ids.append(seq.request_id)
        token_ids.append(token)
        if seq.check_finished(token, worker.eos_token_ids):
            done[i] = (seq.finish_reason, seq.stop_reason)
            finished.append(seq)
        lp = result.logprobs.get(seq.request_id)
        if lp is not None:
            logprobs[i] = lp
    captures = sum(g.num_captures_serving for g in (worker.runner.graphs, worker.runner.piecewise) if g is not None)
    msg = StepOutputs(worker.role, request_ids, token_ids, done, logprobs, sent_s=time.time(),
                      num_graph_captures_serving=captures, num_recomputed=worker.num_recomputed())
    return msg, finished


class SideWorker(WorkerBase):
    """A side of the bullet schedule: predicts and records its steps, and records a split switch when it
    completes it (the performance model and records: bullet_ray.engine.worker.policy_link)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        model, self.perf_source = make_perf_model(self)
        self.recorder = StepRecorder(self, model)
        self._next_record: tuple[Any, float, bool, int] | None = None  # the planned batch's prediction
        self._selects_at_plan = 0  # partitioner.num_selects when it was planned

    def follow_split(self, target: int | None = None) -> None:
        before = self.partitioner.current_index
        super().follow_split(target)
        if self.partitioner.current_index != before:
            # whether the other side acked too is read under the state block's lock (never only here: both sides
            # could store their ack and each read the other's old one), so the side that acks last records it
            latency_us = self.res.state.record_switch_done()  # None: the other side has not acked yet
            if latency_us is not None:
                self.recorder.log_switch(latency_us, self.partitioner.current_index)
                self._note_drain()  # neither side may have a step in flight on the old entry

    def on_idle(self) -> None:
        """The row's IS_ACTIVE is written at each published step, but a side can run out of work without a step
        (a decode side that preempted its last sequence), and the other side reads it (the policy's view of
        decode, the performance model's "other side busy")."""
        self.res.state.mark_idle(self.side)

    def switch_pending(self) -> bool:
        """A requested split this side has not acked yet (it must step through its loop to follow)."""
        return self.partitioner.side != "both" and self.switch.current(self.partitioner.side) != self.switch.requested()

    def predicted(self, batch: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Predict the planned batch's step time with the performance model (kept until it is launched)."""
        self._next_record = self.recorder.predict(batch) if batch else None
        self._selects_at_plan = self.partitioner.num_selects  # moves from here on: `after_launch` looks
        return batch

    def after_launch(self, step: Any) -> None:
        step.perf_record = self._next_record  # (shape, predicted seconds, other side busy, ladder index)
        if step.perf_record is not None:  # a layer-wise step that moved between its groups (and maybe back)
            step.runs_on = self.partitioner.current_index  # where its last kernels run (layer-wise: its last groups)
            moved_to = self.partitioner.selected_since(self._selects_at_plan)
            step.moved_while_launching = any(i != step.perf_record[3] for i in moved_to)
        step.launched_unsettled = self.switch.overlap and not self.switch.is_settled()
        step.launch_epoch = self.switch.epoch()
        step.beside_other_entry = self._other_runs_elsewhere(step)
        # `self.inflight` is still the previous step here: the oldest uncollected one is it, else this one
        self._publish_inflight(self.inflight if self.inflight is not None else step)

    def collect(self, step: Any) -> Any:
        result = super().collect(step)
        # `self.inflight` is the next step if one was launched ahead (else None, or still `step` itself)
        self._publish_inflight(self.inflight if self.inflight is not step else None)
        self._note_drain()  # this may have been the last step on an entry a switch left
        return result

    def _note_drain(self) -> None:
        """Log a settled switch's drain once no step of either side runs on the old entry any more (the acks
        mean each side's next launch is on the new one; a step launched ahead or in flight still runs where it
        was launched)."""
        drained = self.res.state.record_drain_if_done()
        if drained is not None:
            self.recorder.log_drain(*drained)

    def _publish_inflight(self, oldest: Any) -> None:
        """Tell the other side which entry this side's oldest uncollected step runs on (None: nothing): where it
        was launched (`runs_on`); a layer-wise step's last groups run where the side was when they were launched,
        not where it was planned, nor where the side has moved since (a step launched ahead after it)."""
        record = oldest.perf_record if oldest is not None else None
        if record is None:
            self.res.state.set_inflight_index(self.side, None)
        else:
            self.res.state.set_inflight_index(self.side, oldest.runs_on if oldest.runs_on is not None else record[3])

    def _other_runs_elsewhere(self, step: Any) -> bool:
        """Whether the other side has a step in flight on another ladder entry than `step`'s whose SMs overlap
        `step`'s: after an overlap switch the side that grew first shares SMs with the other's last step on the
        old entry until it ends (a side that shrank first shares none: the groups are nested)."""
        record = step.perf_record
        if record is None:
            return False
        other = self.res.state.inflight_index(self.side.other)
        return other is not None and other != record[3] and self.switch.shares_sms(self.partitioner.side, record[3], other)

    def publish_step(self, step: Any, started: float, result: StepResult, num_queued: int,
                     queued_tokens: int) -> None:
        """Record the collected step (measured vs predicted, online correction) and publish its row. A step
        across a switch ran on no one entry alone, and the model does not learn from it: this side moved while
        it ran (layer groups, even back to the entry it was planned on, or overlap mode), or, in overlap mode, it was launched before the other side
        followed or a switch was requested while it ran, or the other side had a step in flight on another entry
        sharing its SMs at its launch or its collect (the SMs that changed hands ran both)."""
        shape, predicted, busy, index = step.perf_record
        across = index != self.partitioner.current_index or step.moved_while_launching or step.launched_unsettled \
            or step.beside_other_entry \
            or self._other_runs_elsewhere(step) \
            or (self.switch.overlap and self.switch.epoch() != step.launch_epoch)  # asked to move meanwhile
        self.recorder.record(shape, predicted, busy, index, started, num_queued, queued_tokens, self.has_work(),
                             step.num_layer_groups, step.gpu_time_s, step.log_fields(), step.graphs,
                             across_switch=across)
        self.recorder.enter_ring()  # before the count: a reader of the new STEP finds the step's entry
        self.publish(len(step.batch), result.num_tokens, result.num_context_tokens, started, num_queued, index)


class PrefillWorker(SideWorker):
    role = "prefill"
    side = Side.PREFILL

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = PrefillScheduler(*admitting_scheduler_args(self))
        self.decider = SplitDecider(self, self.recorder.model, self.recorder) if is_policy_on(self) else None
        cfg = self.config
        self.layer_groups = LayerGroups(cfg.prefill_layer_groups, cfg.prefill_layer_group_min_tokens)
        self.first_tokens = FirstTokenLog(self.recorder.log)  # the same file as the recorder's rows
        self.handoff_outbox = HandoffOutbox()  # connected by the front's ConnectHandoff (handoff: direct)

    def num_recomputed(self) -> int:
        return self.scheduler.num_reclaimed

    def close(self) -> None:
        self.handoff_outbox.close()
        super().close()

    def handle(self, msg: Any) -> None:
        if isinstance(msg, ConnectHandoff):
            self.handoff_outbox.connect(msg.address, self.spec.authkey)
            return
        add = expect_add_request(self, msg)
        self.scheduler.add(sequence_from_request(add), front=add.resume is not None)
        self.first_tokens.received(add)
        if self.decider is not None and add.resume is None:
            self.decider.note_prompt(len(add.prompt_token_ids))

    def has_work(self) -> bool:
        if len(self.scheduler) > 0 or self.switch_pending():
            return True
        return self.decider is not None and self.decider.is_due()

    def abort(self, request_ids: list[str]) -> None:
        self.first_tokens.forget(request_ids)
        missed = []
        for rid in request_ids:
            seq = self.scheduler.abort(rid)
            if seq is not None:
                seq.finish_reason = "abort"
            elif self.abort_awaiting(rid) is None:
                missed.append(rid)
        if missed:
            self.conn.send(AbortMissed(missed))

    def next_step_is_eager(self) -> bool:
        return False  # planned first (a collect cannot change a prefill batch), then `batch_runs_eagerly`

    def batch_runs_eagerly(self, batch: list[ScheduledSeq]) -> bool:
        num_tokens = sum(item.num_new_tokens for item in batch)
        return self.layer_groups.applies(num_tokens) or self.runs_eagerly(0, num_tokens)

    def wait_to_plan(self) -> None:
        """With `prefill_plan_lead_ms`: until the step in flight ends or is `lead` from its predicted end, take
        messages instead of planning, so that a prompt arriving during a long prefill step joins the next
        batch (planned at once, the next batch is fixed and launched before it arrives: it then waits for
        the step in flight and the next). The predicted end: the model's step time from when the GPU took
        the step (its launch, or the collect of the one before if that came later)."""
        lead_ms, step = self.config.prefill_plan_lead_ms, self.inflight
        record = getattr(step, "perf_record", None)
        if lead_ms is None or step is None or step.done is None or record is None:
            return  # nothing in flight, or on CPU (a launch there computes the step)
        due = max(step.launched_s, self.last_done_s) + record[1] - lead_ms / 1e3
        while not self.is_stopped and not step.done.query():
            left = due - time.perf_counter()
            if left <= 0:
                return
            if self.conn.poll(min(left, PLAN_WAIT_POLL_S)):
                self.dispatch(self.conn.recv())

    def plan(self) -> list[ScheduledSeq]:
        if self.decider is not None:
            self.decider.decide()  # the split and the queue's order, from this step's state
            self.follow_split()  # a shrinking prefill side moves at once
            if self.decider.is_mixed:
                self._hand_over_prompts()
        if self.partitioner.current.prefill_sms == 0:
            return []  # the whole-GPU entry is decode's: wait (taking messages) until decode gives SMs back
        if self.res.state.num_handed_prompts_held() > 0:
            return []  # decode still prefills prompts the mixed fallback handed it: wait for them (module docstring)
        batch = self.scheduler.schedule()
        if self.decider is not None:
            self.decider.wait_to_grow(batch)  # a long step may wait for decode's ack of a bigger prefill side
        self.first_tokens.scheduled(batch)
        return self.predicted(batch)

    def _hand_over_prompts(self) -> None:
        """Mixed fallback: every queued prompt goes to the decode worker (through the front, as a hand-off
        with what is computed so far), which prefills the rest in chunks inside its steps. The step in flight
        is collected first: a prompt it chunks must not be continued by decode before its KV is written."""
        if not len(self.scheduler):
            return
        self._finish_inflight()
        seqs = list(self.scheduler.waiting)
        if not seqs:
            return
        self.scheduler.remove(seqs)
        self.first_tokens.forget([s.request_id for s in seqs])
        assert self.decider is not None
        self.decider.note_prompts_handed_over()
        self.res.state.count_handed_prompts(Policy.PROMPTS_HANDED_OVER, len(seqs))  # before they can arrive
        self.conn.send(StepOutputs(self.role, prompts_handed_over=[s.to_wire() for s in seqs], sent_s=time.time()))

    def launch(self, batch: list[ScheduledSeq], num_layer_groups: int = 1, between_groups: Any = None) -> Any:
        """A long batch runs layer-wise: the split may move between its layer groups (collected synchronously
        before: no earlier step is in flight while the split moves)."""
        if not self.layer_groups.applies(sum(item.num_new_tokens for item in batch)):
            return super().launch(batch)
        self._finish_inflight()
        self.res.state.set_inflight_index(self.side, self.partitioner.current_index)  # its first groups run here
        return super().launch(batch, self.layer_groups.num_groups, self._between_layer_groups)

    def _between_layer_groups(self) -> Any:
        """A step boundary inside a layer-wise prefill (its groups so far have finished): decide the split
        again and follow it; returns the stream the next group launches on. An entry without prefill SMs (the
        mixed fallback's whole-GPU entry) is followed only after the step: its groups need SMs to finish on."""
        if self.decider is not None:
            self.decider.decide()
        ladder, want = self.partitioner.ladder, self.switch.requested()
        if not (0 <= want < len(ladder) and ladder[want].prefill_sms == 0):
            self.follow_split(want)  # the entry just checked: a request landing now waits for the next boundary
            self.res.state.set_inflight_index(self.side, self.partitioner.current_index)  # the next groups run here
            self._note_drain()  # the groups so far have finished: this side may have left the old entry now
        stream = self.partitioner.current_stream(self.partitioner.side) if self.partitioner.side != "both" else None
        self._last_stream = stream
        return stream

    def after_launch(self, step: Any) -> None:
        super().after_launch(step)
        self.scheduler.remove(step.sampled)  # prefill complete: they leave the queue (handed off once collected)

    def process(self, result: StepResult, step: Any, started_s: float) -> None:
        msg, finished = step_outputs(self, result)
        self.first_tokens.sampled(result.sampled)
        handoffs = [seq.to_wire() for seq in result.sampled if seq.finish_reason is None]
        for seq in finished:
            release(seq, self.allocator)
        if handoffs and self.decider is not None:
            self.decider.note_handoff()
        queued_tokens = sum(s.num_uncomputed_tokens for s in self.scheduler.waiting)
        self.publish_step(step, started_s, result, len(self.scheduler), queued_tokens)
        if not (msg.request_ids or handoffs):
            return
        if not self.handoff_outbox.is_connected:
            self.conn.send(dataclasses.replace(msg, handoffs=handoffs))
            return
        # handoff: direct. The front hears first: its message (with these first tokens) is then in its socket
        # before the decode worker can send a token of theirs, and it reads the prefill side's socket first
        # (front_link.WorkerLink._receive_loop), so a request's tokens reach the client in order. The hand-offs carry the
        # message's stamp: both ways time a hand-off from the same point (the front's relay: Handoff.sent_s)
        self.conn.send(dataclasses.replace(msg, handed_direct=[wire.request_id for wire in handoffs]))
        for i, wire in enumerate(handoffs):
            if not self.handoff_outbox.send(Handoff(wire, sent_s=msg.sent_s)):
                # the decode worker went away: the front relays the rest (and finds decode gone)
                self.conn.send(StepOutputs(self.role, handoffs=handoffs[i:], sent_s=msg.sent_s))
                break


class DecodeWorker(SideWorker):
    """The decode side. Under overload (`mixed_fallback_tokens`) the prefill worker hands it its queued prompts
    (with what is computed so far): it then runs chunked-prefill steps, its decode rows first and the token
    budget filled with chunks of those prompts in least-slack order, until they are done; the prefill worker
    plans nothing until each has left `prompts` (promoted or aborted: HANDED_PROMPTS_DONE, module docstring)."""

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
                                 targets)
        self.prompts.waiting.clear()
        self.prompts.waiting.extend(ordered)

    def after_launch(self, step: Any) -> None:
        super().after_launch(step)
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


class HybridWorker(WorkerBase):
    """The chunked-prefill baseline: prefill chunks and decodes in one batch per step, one process."""

    role = "hybrid"
    side = Side.DECODE

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = ChunkedScheduler(*admitting_scheduler_args(self))
        self._log = StepLog(self.config.step_log_path)  # the bullet sides' rows, without a prediction
        self.first_tokens = FirstTokenLog(self._log)

    def num_recomputed(self) -> int:
        return self.scheduler.num_preemptions

    def handle(self, msg: Any) -> None:
        add = expect_add_request(self, msg)
        self.scheduler.add(sequence_from_request(add))
        self.first_tokens.received(add)

    def has_work(self) -> bool:
        return self.scheduler.num_waiting + self.scheduler.num_running > 0

    def next_step_is_eager(self) -> bool:
        """Decided before planning: the plan holds running sequences that the collect may finish. A step
        with prompt chunks has at most the token budget (one token per running sequence, if more)."""
        running = self.scheduler.num_running
        if self.scheduler.num_waiting == 0:
            return self.runs_eagerly(running)
        return self.runs_eagerly(running, max(self.config.max_num_batched_tokens, running))

    def abort(self, request_ids: list[str]) -> None:
        self.first_tokens.forget(request_ids)
        for rid in request_ids:
            seq = self.scheduler.abort(rid)
            if seq is not None:
                seq.finish_reason = "abort"

    def plan(self) -> list[ScheduledSeq]:
        batch = self.scheduler.schedule()
        self.first_tokens.scheduled(batch)
        return batch

    def after_launch(self, step: Any) -> None:
        self.scheduler.after_step(step.sampled)  # prompts done: decode from the next step on

    def process(self, result: StepResult, step: Any, started_s: float) -> None:
        msg, finished = step_outputs(self, result)
        for seq in finished:
            self.scheduler.finish(seq)
        self.publish(len(step.batch), result.num_tokens, result.num_context_tokens, started_s,
                     self.scheduler.num_waiting)
        if self._log.enabled:
            self._log_step(step, started_s)
            self.first_tokens.sampled(result.sampled)
        if msg.request_ids:
            self.conn.send(msg)

    def _log_step(self, step: Any, started_s: float) -> None:
        num_prefill = sum(1 for item in step.batch if item.num_new_tokens > 1)  # prompt chunks (a decode: 1)
        phase = "decode" if num_prefill == 0 else ("prefill" if num_prefill == len(step.batch) else "mixed")
        host_s = time.perf_counter() - started_s
        measured_s = step.gpu_time_s if step.gpu_time_s is not None else host_s
        self._log.write(
            "step", side="hybrid", phase=phase, num_tokens=step.num_tokens, num_seqs=len(step.batch),
            num_prefill_seqs=num_prefill, num_context_tokens=step.num_context_tokens,
            num_queued=self.scheduler.num_waiting, measured_ms=round(measured_s * 1e3, 4),
            host_ms=round(host_s * 1e3, 4), graphs=step.graphs, **step.log_fields())
