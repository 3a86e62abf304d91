"""What the worker roles share: a new request's sequence, the admitting scheduler's arguments, a step's
outputs message, and `SideWorker`, the base of the bullet schedule's two sides (predicted and recorded
steps, split switches)."""

from __future__ import annotations

import time
from typing import Any

import torch

from bullet_ray.engine.messages import AddRequest, StepOutputs
from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.worker.main import WorkerBase, available_cores, cpu_threads
from bullet_ray.engine.worker.policy_link import StepRecorder, make_perf_model


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

    def follow_split(self, target: int | None = None, site: str = "loop") -> None:
        before = self.partitioner.current_index
        # where this side was, read before the follow (in disjoint mode it collects the step in flight first)
        had_inflight, last_done = self.inflight is not None, self.last_done_s
        super().follow_split(target, site)
        if self.partitioner.current_index != before:
            # whether the other side acked too is read under the state block's lock (never only here: both sides
            # could store their ack and each read the other's old one), so the side that acks last records it
            latency_us = self.res.state.record_switch_done()  # None: the other side has not acked yet
            if latency_us is not None:
                now = time.perf_counter()
                decided = now - latency_us / 1e6
                began, ended = self._launch_began_s, self._launch_ended_s  # this side's last launch (0: none)
                self.recorder.log_switch(latency_us, self.partitioner.current_index, site=site,
                                         inflight=had_inflight, launching=self._launching,
                                         since_collect_ms=round((now - last_done) * 1e3, 3) if last_done else None,
                                         gc_ms=self.gc_pauses.within_ms(decided, now),
                                         launch_began_ms=round((decided - began) * 1e3, 3) if began else None,
                                         launch_ended_ms=round((decided - ended) * 1e3, 3) if ended else None)
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
        """Predict the planned batch's step time with the performance model (kept until it is launched). On CPU,
        size this side's threads by whether the other side has work (`main.cpu_threads`), having marked its own
        row active first: IS_ACTIVE is otherwise written when a step is published, so a side waking from idle
        would look idle to the other for its whole first step (GPU sides keep that meaning untouched)."""
        cpu_step = bool(batch) and not self.config.is_gpu
        if cpu_step:
            self.res.state.mark_active(self.side)
        self._next_record = self.recorder.predict(batch) if batch else None
        if cpu_step:
            threads = cpu_threads(self.role, available_cores(), other_busy=self._next_record[2])  # type: ignore[index]
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)
        self._selects_at_plan = self.partitioner.num_selects  # moves from here on: `after_launch` looks
        return batch

    def after_launch(self, step: Any) -> None:
        step.perf_record = self._next_record  # (shape, predicted seconds, other side busy, ladder index)
        if step.perf_record is not None:  # a layer-wise step that moved between its groups (and maybe back)
            step.runs_on = self._runs_on_now()  # where it holds SMs last (layer-wise: its last groups)
            moved_to = self.partitioner.selected_since(self._selects_at_plan)
            step.moved_while_launching = any(i != step.perf_record[3] for i in moved_to)
        step.launched_unsettled = self.switch.overlap and not self.switch.is_settled()
        step.launch_epoch = self.switch.epoch()
        step.beside_other_entry = self._other_runs_elsewhere(step)
        # `self.inflight` is still the previous step here: the oldest uncollected one is it, else this one
        self._publish_inflight(self.inflight if self.inflight is not None else step)

    def _runs_on_now(self) -> int:
        """The entry a step launched now is published on: where this side is (its last kernels ran there)."""
        return self.partitioner.current_index

    def collect(self, step: Any) -> Any:
        result = super().collect(step)
        # inside a launch (between a decode step's pieces) the launching step, not yet `self.inflight`, is the oldest
        # once `step` is collected: the hook that collects publishes it (DecodeWorker._between_pieces)
        if not self._launching:  # `self.inflight` is the next step if one was launched ahead (else None, or `step`)
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
                             step.num_layer_groups, step.gpu_time_s, {**step.log_fields(), **self.gc_pauses.take()},
                             step.graphs,
                             across_switch=across)
        self.recorder.enter_ring()  # before the count: a reader of the new STEP finds the step's entry
        self.publish(len(step.batch), result.num_tokens, result.num_context_tokens, started, num_queued, index)
