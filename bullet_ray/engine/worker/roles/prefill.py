"""`PrefillWorker`: the bullet schedule's prefill side (the package docstring has the KV-progress rules)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from bullet_ray.engine.layerwise import LayerGroups
from bullet_ray.engine.messages import AbortMissed, ConnectHandoff, Handoff, StepOutputs
from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import ScheduledSeq, release
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.state_block import Policy, Side
from bullet_ray.engine.worker.handoff import HandoffOutbox
from bullet_ray.engine.worker.policy_link import FirstTokenLog, SplitDecider, is_policy_on
from bullet_ray.engine.worker.roles.side import (
    SideWorker,
    admitting_scheduler_args,
    expect_add_request,
    sequence_from_request,
    step_outputs,
)

# how often `wait_to_plan` looks at the step in flight while no message comes
PLAN_WAIT_POLL_S = 0.001


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

    def idle_wait_s(self) -> float:
        """With `prefill_idle_decide_ms` and the split policy, while decode runs (or was just handed sequences): that
        wait, so the split is decided again about once per decode step (`has_work` is due once decode has published
        one); else the idle wait."""
        wait_ms = self.config.prefill_idle_decide_ms
        if wait_ms is None or self.decider is None or not self.decider.decode_is_busy():
            return super().idle_wait_s()
        return wait_ms / 1e3

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
        the step (its launch, or the collect of the one before if that came later). Not after a layer-wise
        step: its groups ran before its launch returned, so the whole step's prediction from then would put
        the plan past its end."""
        lead_ms, step = self.config.prefill_plan_lead_ms, self.inflight
        record = getattr(step, "perf_record", None)
        if lead_ms is None or step is None or step.done is None or record is None:
            return  # nothing in flight, or on CPU (a launch there computes the step)
        if getattr(step, "num_layer_groups", 1) > 1:
            return  # layer-wise: plan at once, as without a lead
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
            self.follow_split(site="plan")  # a shrinking prefill side moves at once
            if self.decider.is_mixed:
                self._hand_over_prompts()
        if self.partitioner.current.prefill_sms == 0:
            return []  # the whole-GPU entry is decode's: wait (taking messages) until decode gives SMs back
        if self.res.state.num_handed_prompts_held() > 0:
            return []  # decode still prefills prompts the mixed fallback handed it: wait for them (package docstring)
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

    def launch(self, batch: list[ScheduledSeq], num_layer_groups: int = 1, between_groups: Any = None,
               move_pending: Any = None, before_forward: Any = None, before_sample: Any = None) -> Any:
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
            self.follow_split(want, site="group")  # the entry just checked: a request landing now waits for the next boundary
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
