"""The discrete-event replay of benchmarks.replay_split: a run's requests through both bullet sides and the real
BulletPolicy (see the package docstring for what it models and leaves out)."""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.refit_from_steps import sample_of
from benchmarks.replay_split.fits import StepModel
from benchmarks.replay_split.noise import Delays
from benchmarks.rescore import load_run as load_bench_run
from benchmarks.rescore import timed_record
from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.model import PerfModel
from bullet_ray.policy.bullet import BulletPolicy
from bullet_ray.policy.state import DecodeLoad, QueuedRequest, SplitDecision, StepState


@dataclass(frozen=True)
class Request:
    request_id: str
    scheduled_s: float  # when the client sent it, from the run's start
    num_prompt_tokens: int
    num_output_tokens: int  # the first token (from prefill) included


AT_RISK = "at_risk"  # DecodePause's pseudo-reason: any decision that predicts a TTFT miss


@dataclass(frozen=True)
class DecodePause:
    """A what-if the engine does not have: after a split decision of one of `reasons` (BACKLOG: queued requests miss
    their TTFT whatever the split; BALANCE: TTFT at risk with decode over its TPOT target; the pseudo-reason AT_RISK:
    any decision that predicts a queued request past its TTFT target, HOLD and TO_PREFILL included) and while decode
    has sequences, the next prefill step runs on the whole GPU with decode paused, if every running sequence's TPOT
    still ends under `tpot_aim` x the TPOT target with the pause added (its tokens so far, the pause, and its remaining
    tokens at decode's last step time). The paused step starts when decode's step in flight ends; its time is the
    log's fit on the largest prefill entry with decode idle (116 SMs) / `speedup` (the whole GPU's 132 SMs alone:
    ~41k tokens/s against ~37k on 116, `serve_h200_m6` step logs). The online correction does not learn from paused
    steps (no ladder entry holds them)."""

    speedup: float = 1.1
    tpot_aim: float = 0.9
    reasons: tuple[str, ...] = ("backlog", "balance")
    prefill_sms: int = 116  # the fitted entry a paused step's time is taken from

    def follows(self, split: SplitDecision | None) -> bool:
        """Whether a pause may follow this split decision (None: none made yet): its reason is one of `reasons`, or
        AT_RISK is and the decision predicts a queued request past its TTFT target (at risk, or already late)."""
        if split is None:
            return False
        if split.reason.value in self.reasons:
            return True
        slack = split.worst_ttft_slack_s
        return AT_RISK in self.reasons and (split.num_ttft_at_risk > 0 or (slack is not None and slack < 0))


def load_requests(path: Path) -> tuple[list[Request], list[Any]]:
    """The run's requests in send order, and its measured records for bullet_ray.bench.slo / rescore.miss_kinds."""
    rows = sorted(load_bench_run(path)["requests"], key=lambda r: r["scheduled_s"])
    reqs = [Request(str(r["index"]), float(r["scheduled_s"]), int(r.get("prompt_tokens") or r["prompt_tokens_requested"]),
                    int(r.get("output_tokens_requested") or len(r.get("itl_s") or []) + 1)) for r in rows]
    measured = [timed_record(r) for r in rows]
    return reqs, measured


@dataclass
class Outcome:
    ttft_s: list[float | None]  # client TTFT per request (None: never served)
    tpot_s: list[float | None]  # None: one output token
    num_tokens: list[int]  # output tokens each request got
    decisions: Counter = field(default_factory=Counter)  # split decisions by reason
    pauses: list[tuple[float, float]] = field(default_factory=list)  # DecodePause: (start, end) of each paused step
    decode_sms_s: dict[int, float] = field(default_factory=dict)  # decode step seconds by decode SMs
    max_decode_seqs: int = 0
    model_errors: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    # in order: ("prefill" | "decode", launch time, ladder entry it runs on), ("request", decision time, entry
    # requested) for each decision that changed the requested entry, and ("pause", start, -1) for a paused step
    timeline: list[tuple[str, float, int]] = field(default_factory=list)


@dataclass
class _Seq:
    index: int  # the request's position
    context: int  # KV tokens
    tokens: int  # output tokens so far
    ready_s: float = 0.0  # when it may join decode


def warm_up(model: PerfModel, log_steps: Sequence[dict], ladder: Sequence[int] | None = None) -> None:
    """Feed logged steps (`steps_before`) to the model's online correction, as the served engine had learned
    them before the run began. The correction is kept per ladder entry: with the replayed policy's `ladder` (decode
    SM counts) a step counts for the entry of its decode SMs, and one whose split is not on that ladder (a what-if
    ladder, `--ladder`) only for its size and side (entry -1, which no entry asks for); without, for its logged
    split_index."""
    where = {sms: i for i, sms in enumerate(ladder)} if ladder is not None else None
    for r in log_steps:
        s = sample_of(r)
        index = r["split_index"] if where is None else where.get(int(r.get("decode_sms", -1)), -1)
        model.observe(s.shape, s.sms, s.other_busy, index, s.measured_s)


def steps_before(log_records: list[dict], start_unix_s: float) -> list[dict]:
    """The log's steps learned from before `start_unix_s` (the run's start): the earlier rates' served steps."""
    return [r for r in log_records if r.get("kind") == "step" and r.get("t", math.inf) < start_unix_s
            and not r.get("across_switch")
            and r.get("phase") in ("prefill", "decode") and r.get("measured_ms", 0) > 0]


def replay(reqs: Sequence[Request], steps: StepModel, policy: BulletPolicy, rng: random.Random | None = None,
           overhead_s: float = 0.014, relay_s: float = 0.001, warm: Sequence[dict] = (),
           delays: Delays | None = None, pause: DecodePause | None = None) -> Outcome:
    """One replay (see the module docstring); `policy` is fresh (its model's online correction starts empty, then
    learns the steps `warm`); `rng` None: no noise. `delays`: each arrival reaches the prefill queue a drawn
    `to_worker` delay later, and each hand-off takes a drawn `handoff` delay instead of `relay_s` (drawn from their
    own generator, seeded by one draw of `rng`, or 0 without it, so the step noise stays as without delays).
    `pause`: the DecodePause what-if (None: as the engine runs)."""
    half = overhead_s / 2
    if steps.residuals is not None:
        steps.residuals.reset()
    delay_rng = random.Random(rng.random() if rng is not None else 0) if delays is not None else None
    model = policy.model
    rule = policy.rule
    warm_up(model, warm, rule.decode_sms)
    n = len(reqs)
    out = Outcome([None] * n, [None] * n, [0] * n)
    first: list[float] = [math.nan] * n
    by_id = {r.request_id: i for i, r in enumerate(reqs)}
    events: list[tuple[float, int, str, Any]] = []
    counter = 0

    def push(t: float, kind: str, payload: Any = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    for i, r in enumerate(reqs):
        extra = delays.draw_to_worker(delay_rng) if delays is not None and delay_rng is not None else 0.0
        push(r.scheduled_s + half + extra, "arrive", i)
    requested = 0  # the ladder entry both sides launch on next
    computed: dict[int, int] = {}  # queued request -> prompt tokens in batches so far
    entered: dict[int, float] = {}
    planned: list[tuple[int, int]] | None = None  # (request, tokens) of the next prefill launch
    p_inflight: dict[str, Any] | None = None  # the prefill step running
    running: list[_Seq] = []  # decode batch
    waiting: list[_Seq] = []  # handed off, not yet in a decode step
    d_inflight: dict[str, Any] | None = None
    last_decode: tuple[StepShape, int, bool, int, float] | None = None  # for the next decision's observe
    last_decode_s: float | None = None
    last_split: SplitDecision | None = None  # the last decision's split (DecodePause.follows)
    paused_until: float | None = None  # decode holds until the paused prefill step ends (DecodePause)

    def prefill_shape(batch: list[tuple[int, int]]) -> StepShape:
        return StepShape.of_prompts([take + computed[i] for i, take in batch], [computed[i] for i, _ in batch])

    def compute(batch: list[tuple[int, int]]) -> list[int]:
        """Count a launched batch's prompt tokens as computed; the requests whose prompt it completes."""
        done = []
        for i, take in batch:
            computed[i] += take
            if computed[i] >= reqs[i].num_prompt_tokens:
                done.append(i)
        return done

    def decide(now: float) -> None:
        nonlocal planned, requested, last_decode, last_split
        if last_decode is not None:  # SplitDecider._observe_decode: decode's last step since the decision before
            shape, sms, busy, index, measured = last_decode
            model.observe(shape, sms, busy, index, measured)
            last_decode = None
        queue = tuple(QueuedRequest(reqs[i].request_id, reqs[i].num_prompt_tokens, now - entered[i], done)
                      for i, done in computed.items() if done < reqs[i].num_prompt_tokens
                      and not (planned and any(j == i for j, _ in planned)))
        incoming = p_inflight["done"] if p_inflight else []
        seqs = running + waiting
        num_seqs = len(seqs) + len(incoming)
        ctx = sum(s.context for s in seqs) + sum(reqs[i].num_prompt_tokens + 1 for i in incoming)
        remaining = max(0.0, p_inflight["predicted_end"] - now) if p_inflight else 0.0
        state = StepState(requested, queue, DecodeLoad(num_seqs, ctx, last_decode_s if running else None), now,
                          remaining)
        result = policy.step(state)
        last_split = result.split
        out.decisions[last_split.reason.value] += 1
        if result.split.index != requested:
            out.timeline.append(("request", now, result.split.index))
        requested = result.split.index
        if result.batches and planned is None:
            cap, used, batch = policy.token_cap, 0, []
            for q in result.batches[0]:
                take = min(q.num_remaining_tokens, cap - used)
                if take <= 0:
                    break
                batch.append((by_id[q.request_id], take))
                used += take
            planned = batch
            if p_inflight is None:
                launch_prefill(now)

    def pause_fits(now: float, start: float, pause_s: float) -> bool:
        """Every decoding sequence's TPOT, with decode held from `now` to the paused step's end, stays under the aim."""
        assert pause is not None
        if not (running or waiting):
            return False  # nothing decodes: no pause (the what-if is decode's slack, not prefill alone on 132 SMs)
        aim = pause.tpot_aim * rule.targets.tpot_s
        step_s = last_decode_s if last_decode_s is not None else aim
        for s in running + waiting:
            n = reqs[s.index].num_output_tokens
            end = start + pause_s + (n - s.tokens) * step_s
            if n > 1 and (end - first[s.index]) / (n - 1) > aim:
                return False
        return True

    def launch_paused(now: float, batch: list[tuple[int, int]]) -> bool:
        """DecodePause: run `batch` on the whole GPU with decode held, if the last decision judged TTFT at risk and
        the pause fits every sequence's TPOT; False: launch it as the engine does."""
        nonlocal p_inflight, paused_until
        if pause is None or not pause.follows(last_split):
            return False
        shape = prefill_shape(batch)
        start = max(now, d_inflight["end"]) if d_inflight is not None else now
        predicted = steps.seconds(shape, pause.prefill_sms, False) / pause.speedup  # noise-free, as the engine knows it
        if not pause_fits(now, start, predicted):
            return False
        real = steps.noisy_seconds(shape, pause.prefill_sms, False, rng) / pause.speedup
        done = compute(batch)
        paused_until = start + real
        p_inflight = {"paused": True, "predicted_end": start + predicted, "done": done}
        out.pauses.append((start, start + real))
        out.timeline.append(("pause", start, -1))
        push(start + real, "prefill_end", real)
        decide(now)
        return True

    def launch_prefill(now: float) -> None:
        nonlocal planned, p_inflight
        assert planned is not None
        batch, planned = planned, None
        if launch_paused(now, batch):
            return
        index = requested
        sms = rule.prefill_sms(index)
        busy = bool(running or waiting or d_inflight)
        shape = prefill_shape(batch)
        predicted = model.predict(shape, sms, busy, index).seconds
        real = steps.noisy_seconds(shape, sms, busy, rng)
        done = compute(batch)
        p_inflight = {"shape": shape, "sms": sms, "busy": busy, "index": index, "predicted": predicted,
                      "predicted_end": now + predicted, "done": done}
        out.timeline.append(("prefill", now, index))
        push(now + real, "prefill_end", real)
        decide(now)  # plan-ahead: the next batch is planned (and the split decided) as this one launches

    def launch_decode(now: float) -> None:
        nonlocal d_inflight, waiting
        if paused_until is not None:
            return  # DecodePause: decode holds until the paused prefill step ends
        joined = [s for s in waiting if s.ready_s <= now]
        waiting = [s for s in waiting if s.ready_s > now]
        running.extend(joined)
        if not running:
            return
        index = requested
        sms = rule.decode_sms[index]
        busy = p_inflight is not None
        shape = StepShape.decode(len(running), sum(s.context for s in running))
        real = steps.noisy_seconds(shape, sms, busy, rng)
        d_inflight = {"shape": shape, "sms": sms, "busy": busy, "index": index,
                      "predicted": model.predict(shape, sms, busy, index).seconds, "end": now + real}
        out.max_decode_seqs = max(out.max_decode_seqs, len(running))
        out.decode_sms_s[sms] = out.decode_sms_s.get(sms, 0.0) + real
        out.timeline.append(("decode", now, index))
        push(now + real, "decode_end", real)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            computed[payload], entered[payload] = 0, now
            if planned is None:  # the side waits for work: plan at once (during a step in flight too)
                decide(now)
        elif kind == "prefill_end":
            step = p_inflight
            assert step is not None
            p_inflight = None
            if step.get("paused"):
                paused_until = None
            else:
                model.observe(step["shape"], step["sms"], step["busy"], step["index"], payload)
                out.model_errors["prefill"].append(abs(step["predicted"] - payload) / payload)
            for i in step["done"]:
                del computed[i]
                first[i] = now
                out.ttft_s[i] = now + half - reqs[i].scheduled_s
                out.num_tokens[i] = 1
                if reqs[i].num_output_tokens > 1:
                    hop = delays.draw_handoff(delay_rng) if delays is not None and delay_rng is not None else relay_s
                    waiting.append(_Seq(i, reqs[i].num_prompt_tokens + 1, 1, now + hop))
                    push(now + hop, "handoff")
            if planned is not None:
                launch_prefill(now)
            if step.get("paused") and d_inflight is None:
                launch_decode(now)  # decode resumes (after a next paused step's launch, it holds again)
        elif kind == "decode_end":
            step, d_inflight = d_inflight, None
            assert step is not None
            last_decode_s = payload
            last_decode = (step["shape"], step["sms"], step["busy"], step["index"], payload)
            out.model_errors["decode"].append(abs(step["predicted"] - payload) / payload)
            for s in running:
                s.tokens += 1
                s.context += 1
                if s.tokens == reqs[s.index].num_output_tokens:
                    out.num_tokens[s.index] = s.tokens
                    out.tpot_s[s.index] = (now - first[s.index]) / (s.tokens - 1)
            running[:] = [s for s in running if s.tokens < reqs[s.index].num_output_tokens]
            if p_inflight is None and planned is None:  # prefill idles: a decision at each decode step
                decide(now)
            launch_decode(now)
        elif kind == "handoff" and d_inflight is None:
            launch_decode(now)
    return out
