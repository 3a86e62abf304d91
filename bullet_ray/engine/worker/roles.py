"""The three worker roles: prefill (bullet), decode (bullet), hybrid (chunked baseline)."""

from __future__ import annotations

import time
from typing import Any

from bullet_ray.engine.messages import AbortMissed, AddRequest, Handoff, StepOutputs, TokenUpdate
from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import release
from bullet_ray.engine.scheduler.chunked import ChunkedScheduler
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.state_block import Side
from bullet_ray.engine.worker.main import WorkerBase
from bullet_ray.engine.worker.policy_link import SplitDecider, StepRecorder, is_policy_on, make_perf_model


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


def token_updates(worker: WorkerBase, result: StepResult) -> tuple[list[TokenUpdate], list[Sequence]]:
    """One update per sampled sequence, and the sequences that finished with it."""
    updates, finished = [], []
    for seq in result.sampled:
        token = seq.output_token_ids[-1]
        is_done = seq.check_finished(token, worker.eos_token_ids)
        lp = result.logprobs.get(seq.request_id)
        updates.append(TokenUpdate(seq.request_id, [token], [lp] if lp is not None else None,
                                   seq.finish_reason, seq.stop_reason))
        if is_done:
            finished.append(seq)
    return updates, finished


class SideWorker(WorkerBase):
    """A side of the bullet schedule: predicts and records its steps, and records a split switch when it
    completes it (the performance model and records: bullet_ray.engine.worker.policy_link)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        model, self.perf_source = make_perf_model(self)
        self.recorder = StepRecorder(self, model)

    def follow_split(self) -> None:
        before = self.partitioner.current_index
        super().follow_split()
        if self.partitioner.current_index != before and self.switch.is_settled():
            self.res.state.record_switch_done()  # this side acked last: both run on the new split

    def switch_pending(self) -> bool:
        """A requested split this side has not acked yet (it must step through its loop to follow)."""
        return self.partitioner.side != "both" and self.switch.current(self.partitioner.side) != self.switch.requested()

    def publish_step(self, record: tuple[Any, float, bool], started: float, num_seqs: int, result: StepResult,
                     num_queued: int, queued_tokens: int) -> None:
        shape, predicted, busy = record
        self.recorder.record(shape, predicted, busy, started, num_queued, queued_tokens, self.has_work())
        self.publish(num_seqs, result.num_tokens, result.num_context_tokens, started, num_queued)
        self.recorder.after_publish()


class PrefillWorker(SideWorker):
    role = "prefill"
    side = Side.PREFILL

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = PrefillScheduler(*admitting_scheduler_args(self))
        self.decider = SplitDecider(self, self.recorder.model, self.recorder) if is_policy_on(self) else None

    def handle(self, msg: Any) -> None:
        add = expect_add_request(self, msg)
        self.scheduler.add(sequence_from_request(add), front=add.resume is not None)
        if self.decider is not None and add.resume is None:
            self.decider.note_prompt(len(add.prompt_token_ids))

    def has_work(self) -> bool:
        if len(self.scheduler) > 0 or self.switch_pending():
            return True
        return self.decider is not None and self.decider.is_due()

    def abort(self, request_ids: list[str]) -> None:
        missed = [rid for rid in request_ids if self.scheduler.abort(rid) is None]
        if missed:
            self.conn.send(AbortMissed(missed))

    def step(self) -> bool:
        if self.decider is not None:
            self.decider.decide()
            self.follow_split()  # a shrinking prefill side moves at once
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return False
        if self.decider is not None and self.decider.wait_to_grow(batch) > 0:
            started = time.perf_counter()  # the wait is the switch's, not the step's
        record = self.recorder.predict(batch)
        result = self.execute(batch)
        updates, finished = token_updates(self, result)
        self.scheduler.remove(result.sampled)
        for seq in finished:
            release(seq, self.allocator)
        handoffs = [seq.to_wire() for seq in result.sampled if seq.finish_reason is None]
        if handoffs and self.decider is not None:
            self.decider.note_handoff()
        queued_tokens = sum(s.num_uncomputed_tokens for s in self.scheduler.waiting)
        self.publish_step(record, started, len(batch), result, len(self.scheduler), queued_tokens)
        if updates or handoffs:
            self.conn.send(StepOutputs(self.role, updates, handoffs))
        return True


class DecodeWorker(SideWorker):
    role = "decode"
    side = Side.DECODE

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = DecodeScheduler(self.allocator, self.config.block_size, self.config.max_num_seqs)

    def handle(self, msg: Any) -> None:
        if isinstance(msg, Handoff):
            self.scheduler.add(Sequence.from_wire(msg.seq))
        else:
            raise TypeError(f"decode worker got unexpected message {type(msg).__name__}")

    def has_work(self) -> bool:
        return len(self.scheduler) > 0 or self.switch_pending()

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort(rid)  # missing: already finished or preempted (the front handles both)

    def step(self) -> bool:
        started = time.perf_counter()
        batch, preempted = self.scheduler.schedule()
        preempted_wires = [seq.to_wire() for seq in preempted]
        if not batch:
            if preempted_wires:
                self.conn.send(StepOutputs(self.role, preempted=preempted_wires))
            return bool(preempted_wires)
        record = self.recorder.predict(batch)
        result = self.execute(batch)
        updates, finished = token_updates(self, result)
        for seq in finished:
            self.scheduler.remove(seq)
        self.publish_step(record, started, len(batch), result, 0, 0)
        self.conn.send(StepOutputs(self.role, updates, preempted=preempted_wires))
        return True


class HybridWorker(WorkerBase):
    """The chunked-prefill baseline: prefill chunks and decodes in one batch per step, one process."""

    role = "hybrid"
    side = Side.DECODE

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.scheduler = ChunkedScheduler(*admitting_scheduler_args(self))

    def handle(self, msg: Any) -> None:
        self.scheduler.add(sequence_from_request(expect_add_request(self, msg)))

    def has_work(self) -> bool:
        return self.scheduler.num_waiting + self.scheduler.num_running > 0

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.scheduler.abort(rid)

    def step(self) -> bool:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return False
        result = self.execute(batch)
        self.scheduler.after_step(result.sampled)
        updates, finished = token_updates(self, result)
        for seq in finished:
            self.scheduler.finish(seq)
        self.publish(len(batch), result.num_tokens, result.num_context_tokens, started,
                     self.scheduler.num_waiting)
        if updates:
            self.conn.send(StepOutputs(self.role, updates))
        return True
