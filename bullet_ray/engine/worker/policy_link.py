"""Where the policy meets the workers: per-step predictions and records, and the split decision.

- `StepRecorder` (both sides): predicts each step with the performance model before it runs, and after it
  writes the prediction, the queue and whether the side stays active into its row of the state block,
  enters (measured, predicted, entry) into the block's ring, feeds the online correction, and appends a
  JSONL record when `step_log_path` is set.
- `SplitDecider` (prefill side, bullet schedule with `split_policy: slo`): at each prefill step boundary,
  and while prefill idles at each wake-up (a message, or every 0.5 s), builds the `StepState` from its own queue and
  decode's row, runs `BulletPolicy.step`, reorders its queue and sizes the next batch as planned, asks for
  the chosen split (when the previous switch has settled) and records the decision in the block. The
  decision thus runs where the step state is, not behind a polling thread in the engine front.
  Under overload (`mixed_fallback_tokens`) it switches the schedule to the mixed fallback instead: the
  prefill worker hands its queued prompts to the decode worker, which prefills them in chunks inside its
  steps on the whole GPU (the partitioner's whole-GPU entry; `SplitDecider.is_mixed`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

from bullet_ray.engine.messages import Wake
from bullet_ray.engine.scheduler.base import is_decode_only
from bullet_ray.engine.state_block import Field, Side, StateBlock
from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.model import PerfModel
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import DecodeLoad, QueuedRequest, SplitReason, StepState

logger = logging.getLogger(__name__)

REASONS: tuple[SplitReason, ...] = tuple(SplitReason)
_HANDOFF_GRACE_S = 0.05  # decode counts as busy this long after prefill handed it sequences
# the mixed fallback ends once the prompts waiting on both sides fall under this share of mixed_fallback_tokens
MIXED_EXIT_SHARE = 0.25


def make_perf_model(worker: Any) -> tuple[PerfModel, str]:
    """The model for this worker's device and model (the matching profile, else the roofline defaults)."""
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.perf.loading import load_perf_model

    cfg = ModelConfig.from_hf_dict(worker.res.handles.model_config)
    entry = worker.partitioner.ladder[0]
    if worker.config.is_gpu:
        import torch

        name = torch.cuda.get_device_name(worker.res.device)
        sm_count = entry.decode_sms + entry.prefill_sms
    else:
        name, sm_count = "cpu", 1
    return load_perf_model(name, sm_count, cfg, worker.config.torch_dtype_name)


def shape_of(batch: list[Any], phase: str) -> StepShape:
    """The StepShape of a batch of ScheduledSeq (exact causal pairs)."""
    tokens = ctx = pairs = 0
    for item in batch:
        n, c = item.num_new_tokens, item.seq.num_computed_tokens
        tokens += n
        ctx += c + n
        pairs += n * (c + n) - n * (n - 1) // 2
    return StepShape(phase, max(1, tokens), max(1, len(batch)), max(ctx, tokens, 1), max(pairs, 1))  # type: ignore[arg-type]


class StepLog:
    """The JSONL file of `step_log_path`, open (line-buffered) for the worker's lifetime; without a path
    nothing is written. Every record starts with its kind and wall-clock time."""

    def __init__(self, path: str | None) -> None:
        if path:  # its folder too, as a profile_dir's
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115 - the process's lifetime

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "t": round(time.time(), 6), **fields}) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class FirstTokenLog:
    """Where a request's time to first token goes inside the workers, one `first_token` record per request in
    the step log: from the front's send to this worker's receipt (`to_worker_ms`), to the plan of the first
    batch with one of its prompt tokens (`queue_ms`), to the collect of the step that sampled its first token
    (`prefill_ms`: with launch-ahead it includes waiting behind the step already in flight);
    `worker_ttft_ms` is their sum (wall clock, one machine). What a client's TTFT adds to it is spent outside
    the workers, in and back: HTTP, Serve's proxy and replica, the front's tokenizing and streaming. Nothing
    is kept without a step log."""

    def __init__(self, log: StepLog) -> None:
        self._log = log
        self._marks: dict[str, list[float]] = {}  # request id -> [front send, receipt, first scheduled or 0]

    def received(self, msg: Any) -> None:
        if self._log.enabled and msg.resume is None:  # a preempted request's first token came long ago
            self._marks[msg.request_id] = [msg.arrival_s, time.time(), 0.0]

    def scheduled(self, batch: list[Any]) -> None:
        if self._marks:
            now = time.time()
            for item in batch:
                mark = self._marks.get(item.seq.request_id)
                if mark is not None and not mark[2]:
                    mark[2] = now

    def sampled(self, seqs: list[Any]) -> None:
        """After a collect: the sequences that sampled a token; a marked one sampled its first."""
        if not self._marks:
            return
        now = time.time()
        for seq in seqs:
            mark = self._marks.pop(seq.request_id, None)
            if mark is not None:
                sent, received, scheduled = mark
                scheduled = scheduled or received
                self._log.write("first_token", request_id=seq.request_id, prompt_tokens=len(seq.prompt_token_ids),
                                to_worker_ms=round((received - sent) * 1e3, 3),
                                queue_ms=round((scheduled - received) * 1e3, 3),
                                prefill_ms=round((now - scheduled) * 1e3, 3),
                                worker_ttft_ms=round((now - sent) * 1e3, 3))

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._marks.pop(rid, None)


class StepRecorder:
    def __init__(self, worker: Any, model: PerfModel) -> None:
        self.worker = worker
        self.model = model
        self.state: StateBlock = worker.res.state
        self.side: Side = worker.side
        self.phase = "prefill" if self.side is Side.PREFILL else "decode"
        self.log = StepLog(worker.config.step_log_path)

    def _sms(self, index: int) -> int:
        entry = self.worker.partitioner.ladder[index]
        return entry.prefill_sms if self.side is Side.PREFILL else entry.decode_sms

    def other_busy(self) -> bool:
        return bool(self.state.rows[int(self.side.other)][Field.IS_ACTIVE])

    def predict(self, batch: list[Any]) -> tuple[StepShape, float, bool, int]:
        """(shape, predicted seconds, other side busy, ladder index) of a planned batch, on the entry this side
        runs on now (where it launches); a decode side's step with prompt chunks (mixed fallback) is
        predicted as a prefill step of all its tokens on the decode SMs."""
        mixed = self.side is Side.DECODE and not is_decode_only(batch)
        shape = shape_of(batch, "prefill" if mixed else self.phase)
        busy = self.other_busy()
        index = self.worker.partitioner.current_index
        return shape, self.model.predict(shape, self._sms(index), busy, index).seconds, busy, index

    def record(self, shape: StepShape, predicted_s: float, other_busy: bool, index: int, started_s: float,
               num_queued: int, queued_tokens: int, is_active: bool, num_layer_groups: int = 1,
               gpu_time_s: float | None = None, host_timings_ms: dict[str, float] | None = None,
               graphs: str | None = None, across_switch: bool = False) -> None:
        """After the step ran on ladder entry `index`: annotate the row (then the worker's `publish` bumps STEP),
        learn, log.

        The measured time is the step's device time where there is one (CUDA events around the step):
        the host's clock from launch to collect also counts host gaps, and with asynchronous scheduling
        it can miss most of a step the device finished while the host was busy elsewhere. A step
        `across_switch` (it ran on more than one entry, or beside the other side's step on shared SMs) is
        logged but neither learned from nor entered into the ring under an entry (index -1 there)."""
        host_s = time.perf_counter() - started_s
        measured_s = gpu_time_s if gpu_time_s is not None else host_s
        self.state.annotate(self.side, predicted_step_us=int(predicted_s * 1e6), queued_tokens=queued_tokens,
                            is_active=is_active)
        if not across_switch:
            self.model.observe(shape, self._sms(index), other_busy, index, measured_s)
        self._pending = (measured_s, predicted_s, -1 if across_switch else index)
        if self.log.enabled:
            entry = self.worker.partitioner.ladder[index]
            self.log.write(
                "step", side=self.side.name.lower(),
                phase="mixed" if self.side is Side.DECODE and shape.phase == "prefill" else shape.phase,
                num_tokens=shape.num_tokens,
                num_seqs=shape.num_seqs, num_context_tokens=shape.num_context_tokens,
                num_attention_pairs=shape.num_attention_pairs, split_index=index, decode_sms=entry.decode_sms,
                prefill_sms=entry.prefill_sms, other_busy=other_busy, num_queued=num_queued,
                predicted_ms=round(predicted_s * 1e3, 4), measured_ms=round(measured_s * 1e3, 4),
                host_ms=round(host_s * 1e3, 4), layer_groups=num_layer_groups, graphs=graphs,
                across_switch=across_switch, **(host_timings_ms or {}))

    def enter_ring(self) -> None:
        """Enter the step just recorded into the ring, before `publish` counts it (readers of a new STEP find
        its entry)."""
        measured_s, predicted_s, index = self._pending
        self.state.record_ring(self.side, int(measured_s * 1e6), int(predicted_s * 1e6), index)

    def log_switch(self, latency_us: int, index: int, site: str = "loop", inflight: bool = False,
                   launching: bool = False, since_collect_ms: float | None = None, gc_ms: float = 0.0,
                   launch_began_ms: float | None = None, launch_ended_ms: float | None = None) -> None:
        """A switch both sides acked: the time from the decision to both launching on `index` (a step either
        launched before may still run on the old entry: `log_drain`). Where the side that acked last was:
        `site` (its message loop, a decode step's launch or a boundary between its pieces, a prefill step's
        planning, wait to grow or layer groups), whether an earlier step of it was in flight (uncollected) when
        it followed, whether it was inside a step's launch (pieces or layer groups: that step runs too), how
        long since it last collected a step (None: idle since), how much of the latency its process spent in
        garbage collections (`gc_ms`, bullet_ray.engine.gc_pauses), and where the decision fell against that side's
        launches: ms from the start of its last launch to the decision (`launch_began_ms`; negative: the launch
        began after it) and from the end of the last launch that had returned by the ack (`launch_ended_ms`; with
        `launching`, the launch before the one in progress)."""
        self.log.write("switch", index=index, decision_to_split_us=latency_us, acked_last=self.side.name.lower(),
                       overlap=self.worker.switch.overlap, site=site, inflight=inflight, launching=launching,
                       since_collect_ms=since_collect_ms, gc_ms=gc_ms, launch_began_ms=launch_began_ms,
                       launch_ended_ms=launch_ended_ms)

    def log_drain(self, latency_us: int, index: int) -> None:
        """A switch that took effect: the time from the decision to no step of either side running on another
        entry than `index` (this side saw it last: it collected the last old step, or acked last with none)."""
        self.log.write("switch_drained", index=index, decision_to_drained_us=latency_us,
                       drained_last=self.side.name.lower(), overlap=self.worker.switch.overlap)

    def log_decision(self, record: dict[str, Any]) -> None:
        self.log.write("decision", **record)


class SplitDecider:
    def __init__(self, worker: Any, model: PerfModel, recorder: StepRecorder) -> None:
        cfg = worker.config
        ladder = [e for e in worker.partitioner.ladder if e.prefill_sms > 0]  # the policy's: no whole-GPU entry
        self.worker = worker
        self.recorder = recorder
        self.state: StateBlock = worker.res.state
        self.top_index = len(ladder) - 1
        # where the mixed fallback runs: the whole-GPU entry, else the one with the most decode SMs
        whole = worker.partitioner.whole_index
        self.mixed_index = whole if whole is not None else self.top_index
        self.policy = cfg.bullet_policy(model, [e.decode_sms for e in ladder],
                                        ladder[0].decode_sms + ladder[0].prefill_sms)
        self.model = model
        self._seen_decode_step = -1
        self._observed_decode_step = 0
        self._last_handoff_s = -1e9
        self._prompt_tokens: deque[int] = deque(maxlen=64)
        self.mixed_tokens: int | None = cfg.mixed_fallback_tokens  # None: no mixed fallback
        self.is_mixed = False  # decode takes the prompts (prefill hands its queue over)
        self._handed_over_at_step = -1  # decode's STEP when prompts were last handed to it

    # inputs -----------------------------------------------------------------------------------------
    def note_prompt(self, num_tokens: int) -> None:
        self._prompt_tokens.append(num_tokens)

    def note_handoff(self) -> None:
        self._last_handoff_s = time.monotonic()

    def note_prompts_handed_over(self) -> None:
        """The prefill worker handed its queued prompts to decode (mixed fallback)."""
        self.note_handoff()
        self._handed_over_at_step = int(self.state.rows[int(Side.DECODE)][Field.STEP])

    def is_due(self) -> bool:
        """While prefill idles: decide again once decode has published a new step."""
        return int(self.state.rows[int(Side.DECODE)][Field.STEP]) != self._seen_decode_step

    def decode_is_busy(self) -> bool:
        """Decode has work, or had sequences handed to it within `_HANDOFF_GRACE_S` (they may not have reached it)."""
        is_active = bool(self.state.rows[int(Side.DECODE)][Field.IS_ACTIVE])
        return is_active or time.monotonic() - self._last_handoff_s < _HANDOFF_GRACE_S

    def _observe_decode(self) -> None:
        """Feed decode's published steps (those still in the ring) to this side's online correction."""
        step, entries = self.state.recent_steps(Side.DECODE, self._observed_decode_step)
        row = self.state.rows[int(Side.DECODE)]
        if entries and row[Field.NUM_TOKENS] <= row[Field.NUM_SEQS]:  # a decode step, not a mixed one
            measured_us, _, index = entries[-1]
            ladder = self.worker.partitioner.ladder
            if 0 <= index < len(ladder) and measured_us > 0 and row[Field.NUM_SEQS] > 0:
                shape = StepShape.decode(int(row[Field.NUM_SEQS]), int(row[Field.NUM_CONTEXT_TOKENS]))
                busy = bool(self.state.rows[int(Side.PREFILL)][Field.IS_ACTIVE])
                self.model.observe(shape, ladder[index].decode_sms, busy, index, measured_us / 1e6)
        self._observed_decode_step = step

    def step_state(self) -> StepState:
        """Both sides as this decision sees them. With a prefill step in flight (asynchronous scheduling:
        the next batch is planned before it is collected) its predicted remainder is `prefill_remaining_s`,
        and the sequences it completes (handed off once collected) already count as decode's."""
        row = self.state.rows[int(Side.DECODE)]
        self._seen_decode_step = int(row[Field.STEP])
        is_active = self.decode_is_busy()
        incoming = list(self.worker.awaiting.values())  # sampling in the step in flight: decode's next
        seqs = int(row[Field.NUM_SEQS]) if is_active else 0
        decode = DecodeLoad(seqs, int(row[Field.NUM_CONTEXT_TOKENS]) if seqs else 0,
                            int(row[Field.STEP_TIME_US]) / 1e6 if seqs and row[Field.STEP] > 0 else None)
        if is_active and seqs == 0:  # sequences handed off before decode ran a step: assume one each
            decode = DecodeLoad(1, 1)
        if incoming:
            decode = DecodeLoad(seqs + len(incoming), (decode.num_context_tokens if seqs else 0)
                                + sum(s.num_tokens for s in incoming), decode.measured_step_s)
        now = time.time()
        queue = tuple(queued_requests(self.worker.scheduler.waiting, now))
        current = min(self.worker.switch.requested(), self.top_index)  # leaving the whole-GPU entry: from the top
        return StepState(current, queue, decode, time.monotonic(), self._inflight_remaining_s())

    def _inflight_remaining_s(self) -> float:
        """Predicted time left of this side's step in flight (0 when none)."""
        step = self.worker.inflight
        if step is None or step.perf_record is None:
            return 0.0
        started = max(step.launched_s, self.worker.last_done_s)  # it runs once the step before has finished
        return max(0.0, step.perf_record[1] - (time.perf_counter() - started))

    # the decision -----------------------------------------------------------------------------------
    def _follow_pushed_targets(self) -> None:
        """SLO targets pushed at run time (LLMEngine.set_slo_targets) replace the config's floor and TPOT target,
        in the policy's targets and in its split rule's, each keeping its own margin (ttft_margin_scope)."""
        pushed = self.state.slo_targets()
        self.policy.targets = with_pushed(self.policy.targets, pushed)
        self.policy.rule.targets = with_pushed(self.policy.rule.targets, pushed)

    def update_mixed(self, state: StepState) -> bool:
        """Whether the schedule runs the mixed fallback from this step on: it starts once `mixed_tokens`
        prompt tokens wait (here and on decode) while decode runs, and ends once fewer than
        MIXED_EXIT_SHARE of it wait, judged only after decode has published two steps since the last
        hand-over (so the prompts in transit count)."""
        if self.mixed_tokens is None:
            return False
        row = self.state.rows[int(Side.DECODE)]
        waiting = sum(r.num_remaining_tokens for r in state.queue) + int(row[Field.QUEUED_TOKENS])
        if not self.is_mixed:
            self.is_mixed = state.decode.num_seqs > 0 and waiting >= self.mixed_tokens
        elif int(row[Field.STEP]) >= self._handed_over_at_step + 2:
            self.is_mixed = waiting >= self.mixed_tokens * MIXED_EXIT_SHARE
        return self.is_mixed

    def _request_split(self, index: int) -> tuple[int, bool]:
        """Ask both sides for ladder entry `index` (moved inside the controller's bounds); returns the entry
        and whether a switch was requested now (False: already there, or the last switch still settling)."""
        switch = self.worker.switch
        # inside the controller's bounds, and never past this worker's ladder (bounds from a longer one)
        index = min(self.state.clamp_to_bounds(index), len(self.worker.partitioner.ladder) - 1)
        is_switch = index != switch.requested() and switch.request(index)
        if is_switch and not self.state.rows[int(Side.DECODE)][Field.IS_ACTIVE]:
            self.worker.conn.send(Wake())  # an idle decode side waits on its pipe: the front relays this
        return index, bool(is_switch)

    def _decide_mixed(self, state: StepState) -> None:
        """The mixed fallback's split: decode on the whole GPU (or the most SMs the controller's bounds
        allow); prefill hands over its queue."""
        started = time.perf_counter()
        index, is_switch = self._request_split(self.mixed_index)
        cost_us = int((time.perf_counter() - started) * 1e6)
        self.state.record_decision(index, REASONS.index(SplitReason.MIXED), cost_us, 0, bool(is_switch))
        if is_switch:
            self.recorder.log_decision({"index": index, "reason": SplitReason.MIXED.value, "switch": True,
                                        "num_queued": len(state.queue), "decode_seqs": state.decode.num_seqs,
                                        "cost_us": cost_us})

    def decide(self) -> None:
        self._follow_pushed_targets()
        self._observe_decode()
        state = self.step_state()
        if self.update_mixed(state):
            self._decide_mixed(state)
            return
        out = self.policy.step(state)
        self._apply_order(out.order, out.batches)
        index, is_switch = self._request_split(out.split.index)
        avg = round(sum(self._prompt_tokens) / len(self._prompt_tokens)) if self._prompt_tokens else 512
        ttft = self.policy.predict_new_ttft_s(state, avg)
        per_token_ns = int(self.policy.ttft_per_prompt_token_s(state) * 1e9)
        self.state.record_decision(index, REASONS.index(out.split.reason), int(out.decision_s * 1e6),
                                   int(ttft * 1e6), bool(is_switch), avg, per_token_ns)
        if is_switch or out.split.reason in (SplitReason.BALANCE, SplitReason.BALANCE_TPOT):
            self.recorder.log_decision({
                "index": index, "reason": out.split.reason.value, "switch": bool(is_switch),
                "decode_step_ms": None if out.split.decode_step_s is None else round(out.split.decode_step_s * 1e3, 3),
                "num_queued": len(state.queue), "decode_seqs": state.decode.num_seqs,
                "ttft_at_risk": out.split.num_ttft_at_risk, "cost_us": round(out.decision_s * 1e6, 1)})

    def wait_to_grow(self, batch: list[Any]) -> float:
        """Before a prefill step on the old split while decode still has to give up SMs: wait for decode's
        ack when the step would gain more from the bigger partition than the wait costs (decode acks at its
        next step boundary, or at once when idle and woken). Returns the seconds waited."""
        worker, switch = self.worker, self.worker.switch
        want = switch.requested()
        if switch.current("prefill") == want or not batch:
            return 0.0
        ladder = worker.partitioner.ladder
        old_sms, new_sms = worker.partitioner.current.prefill_sms, ladder[want].prefill_sms
        if new_sms <= old_sms:
            return 0.0
        shape = shape_of(batch, "prefill")
        decode_busy = bool(self.state.rows[int(Side.DECODE)][Field.IS_ACTIVE])
        gain = (self.model.predict(shape, old_sms, decode_busy).seconds
                - self.model.predict(shape, new_sms, decode_busy).seconds)
        row = self.state.rows[int(Side.DECODE)]
        expected = int(row[Field.STEP_TIME_US]) / 1e6 if decode_busy else 0.002
        if gain <= expected:
            return 0.0
        started = time.perf_counter()
        deadline = started + min(gain, 2 * expected + 0.001)
        while time.perf_counter() < deadline and switch.requested() == want:  # a newer request: plan again
            worker.follow_split(want, site="grow_wait")  # the entry whose prefill SMs were just weighed, never a later one
            if worker.partitioner.current_index == want:
                break
            time.sleep(0.0002)
        return time.perf_counter() - started

    def _apply_order(self, order: tuple[QueuedRequest, ...], batches: tuple[tuple[QueuedRequest, ...], ...]) -> None:
        """Reorder the prefill queue (first batch first) and cap the next step at the first batch's tokens."""
        sched = self.worker.scheduler
        if not order:
            return
        first = [r.request_id for r in batches[0]] if batches else []
        rank = {rid: i for i, rid in enumerate(first + [r.request_id for r in order if r.request_id not in first])}
        sched.waiting = deque(sorted(sched.waiting, key=lambda s: rank.get(s.request_id, len(rank))))
        cap = self.worker.config.max_num_batched_tokens
        tokens = sum(r.num_remaining_tokens for r in batches[0]) if batches else cap
        sched.max_num_batched_tokens = max(1, min(cap, tokens))


def queued_requests(seqs: Any, now: float) -> list[QueuedRequest]:
    """The policy's view of sequences waiting for prefill (`Sequence`s; `now`: time.time())."""
    return [QueuedRequest(s.request_id, s.num_tokens, max(0.0, now - s.arrival_s), s.num_computed_tokens)
            for s in seqs]


def with_pushed(targets: SloTargets, pushed: tuple[float, float] | None) -> SloTargets:
    """`targets` with the (ttft_s, tpot_s) a controller pushed (StateBlock.slo_targets; None: none pushed) in
    place of its floor and TPOT target; the per-prompt-token TTFT, the planning margin and the fallback target,
    which a push does not carry, are kept (the fallback only while it is still after the pushed TTFT)."""
    if pushed is None or pushed == (targets.ttft_s, targets.tpot_s):
        return targets
    fallback = targets.fallback_ttft_s
    return dataclasses.replace(targets, ttft_s=pushed[0], tpot_s=pushed[1],
                               fallback_ttft_s=fallback if fallback is not None and fallback > pushed[0] else None)


def order_by_slack(waiting: Any, model: PerfModel, sms: int, targets: SloTargets,
                   prefill_order: str = "least_slack") -> list[Any]:
    """Sequences waiting for prefill (`Sequence`s) in the policy's least-slack order (bullet_ray.policy.ordering):
    those that can still meet their TTFT target (`targets.ttft_target_s` of their prompt) first, least slack
    first; the late ones after, oldest first; a prompt already started stays first. `sms`: where their prefill
    runs; `prefill_order`: EngineConfig.prefill_order (max_on_time: only the most that make their targets together
    go first; fallback_first: the most that make their fallback targets). Used by the decode side for the prompts the mixed fallback hands it, so that a burst does not all
    wait alike."""
    from bullet_ray.policy.ordering import least_slack_order

    by_id = {s.request_id: s for s in waiting}
    queue = queued_requests(waiting, time.time())

    def own(r: QueuedRequest) -> float:
        return model.predict_prefill_s(r.num_remaining_tokens, r.num_prompt_tokens, sms)

    return [by_id[r.request_id] for r in least_slack_order(queue, own, targets, order=prefill_order)]


def is_policy_on(worker: Any) -> bool:
    """The prefill worker of the bullet schedule with `split_policy: slo` decides the split."""
    return bool(worker.config.uses_split_policy) and worker.partitioner.side == "prefill"
