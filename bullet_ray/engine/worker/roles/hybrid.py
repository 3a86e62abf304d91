"""`HybridWorker`: the chunked schedule's one worker (prompt chunks and decode rows in the same steps)."""

from __future__ import annotations

import time
from typing import Any

from bullet_ray.engine.runner import StepResult
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.scheduler.chunked import ChunkedScheduler
from bullet_ray.engine.state_block import Side
from bullet_ray.engine.worker.main import WorkerBase
from bullet_ray.engine.worker.policy_link import FirstTokenLog, StepLog
from bullet_ray.engine.worker.roles.side import (
    admitting_scheduler_args,
    expect_add_request,
    sequence_from_request,
    step_outputs,
)


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
            host_ms=round(host_s * 1e3, 4), graphs=step.graphs, **step.log_fields(),
            **self.gc_pauses.take())
