"""LLMEngine: the engine front. Tokenizes, admits, streams; the model runs in its worker processes.

Start-up: listen on a Unix socket in a fresh runtime folder, launch the first worker (prefill, or hybrid
for the chunked schedule), which loads the model and creates the shared weights, KV pool and state
block; at their handles launch the decode worker so it maps the same memory, while the first worker captures its
CUDA graphs (bullet_ray.engine.startup_order); ready once both are (`bullet_ray.engine.front_startup`). A
receiver thread turns worker messages into per-request outputs, relays prefilled sequences to the decode worker and
sends preempted ones back to prefill (`bullet_ray.engine.front_link.WorkerLink`, which LLMEngine is built on).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import os
import queue
import secrets
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from multiprocessing.connection import Connection, Listener
from typing import Any

from bullet_ray.config import EngineConfig
from bullet_ray.engine.front_link import WorkerLink
from bullet_ray.engine.front_startup import WorkerStartup
from bullet_ray.engine.launcher import ProcessLauncher, WorkerHandle, WorkerLauncher
from bullet_ray.engine.messages import (
    AddRequest,
    AddRequests,
    Shutdown,
    Wake,
)
from bullet_ray.engine.outputs import (
    CompletionOutput,
    EngineStats,
    RequestOutput,
    merge_outputs,
)
from bullet_ray.engine.protocol import EngineClient, Prompt
from bullet_ray.engine.request_table import OutputSink, RequestState
from bullet_ray.engine.runtime_dir import (
    create_runtime_dir,
    start_watchdog,
)
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.state_block import Side
from bullet_ray.errors import EngineDeadError, InvalidRequest

logger = logging.getLogger(__name__)


@functools.cache
def _reason_names() -> tuple[str, ...]:
    """SplitReason values in the order the state block stores their indexes."""
    from bullet_ray.policy.state import SplitReason

    return tuple(r.value for r in SplitReason)


def _reason_name(code: int) -> str:
    names = _reason_names()
    return names[code] if 0 <= code < len(names) else "?"


class LLMEngine(WorkerLink, WorkerStartup, EngineClient):
    """A prefill/decode worker pair (or one hybrid worker) behind a streaming request API."""

    def __init__(self, config: EngineConfig | None = None, launcher: WorkerLauncher | None = None,
                 startup_timeout_s: float = 900.0, served_model_name: str | None = None) -> None:
        self.config = config or EngineConfig()
        self.launcher = launcher or ProcessLauncher()
        self._served_name = served_model_name or self.config.model
        self._lock = threading.Lock()
        self._requests: dict[str, RequestState] = {}
        self._dead_reason: str | None = None
        self._is_shut_down = False
        self._is_draining = False  # shutdown() began: new requests are refused
        self._init_link()  # counters, hops, retired ids and the TTFT model the workers' messages feed
        self._decode_step_mark: tuple[int, float] | None = None  # (step, monotonic time) of the last stats()
        self._decode_step_avg_s: float | None = None
        self.runtime_dir = create_runtime_dir(self.config.runtime_dir)
        # removes the folder and stops the workers if this process dies without shutdown()
        self.watchdog_pid = start_watchdog(self.runtime_dir)
        self._authkey = secrets.token_bytes(16)
        self._listener = Listener(os.path.join(self.runtime_dir, "engine.sock"), family="AF_UNIX",
                                  authkey=self._authkey)
        self._conns: dict[str, Connection] = {}
        self._send_locks: dict[str, threading.Lock] = {}
        self._workers: dict[str, WorkerHandle] = {}
        self.worker_info: dict[str, dict] = {}
        self._startup_began = time.monotonic()  # when the first worker was launched (_start_workers)
        self._startup_timeout_s = startup_timeout_s
        self._deadlines: dict[str, float] = {}  # per worker: startup_timeout_s from its launch
        try:
            self._start_workers(startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="bullet-engine-recv", daemon=True)
        self._receiver.start()
        self.num_split_requests = 0  # by request_split (by hand); the policy's are in the state block
        from bullet_ray.gpu.partition import DEFAULT_SM_COUNT

        self.sm_count = int(self.worker_info.get("decode", {}).get("num_sms") or DEFAULT_SM_COUNT)
        self.ladder_decode_sms = workers_ladder(self.worker_info, self.config, self.sm_count)
        # the split policy (split_policy: slo) runs in the prefill worker at its step boundaries
        # (bullet_ray.engine.worker.policy_link); the front only reads its records from the state block
        self._drained_steps = {Side.PREFILL: 0, Side.DECODE: 0}
        self._drained_switches = self._drained_drains = 0
        self._split_bounds = (0, len(self.ladder_decode_sms) - 1)  # ladder indexes allowed (set_split_bounds)

    # properties -------------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._served_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # submission -------------------------------------------------------------------------------------
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """A prompt as the token ids the engine runs: text through the model's tokenizer, ids checked against the
        vocabulary; InvalidRequest (naming the field) for an empty prompt, an id out of range, or text without
        a tokenizer. The Serve replica calls it too where it needs a prompt's length before submitting it."""
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise InvalidRequest("this model has no tokenizer: send the prompt as token ids", "prompt")
            ids = list(self._tokenizer.encode(prompt))
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        self._check_in_vocabulary(ids, "prompt")
        return ids

    def _check_in_vocabulary(self, ids: Iterable[int], field: str, what: str = "token ids") -> None:
        """InvalidRequest naming `field` when one of `what` is outside [0, vocab_size)."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", field)

    def _submit(self, prompt: Prompt, params: SamplingParams, request_id: str | None,
                loop: asyncio.AbstractEventLoop | None, sink: OutputSink | None = None) -> RequestState:
        state, add = self._admit(prompt, params, request_id, loop, sink)
        self._observe_prompts([add])
        self._send(state.location, add)
        return state

    def _admit(self, prompt: Prompt, params: SamplingParams, request_id: str | None,
               loop: asyncio.AbstractEventLoop | None, sink: OutputSink | None = None) -> tuple[RequestState, AddRequest]:
        """Check a request and register it (it can be aborted from here on); the message that starts it is the
        caller's to send."""
        self.check_health()
        ids = self.prompt_ids(prompt)
        self._check_in_vocabulary((t for t, _ in params.logit_bias), "logit_bias", "logit_bias token ids")
        params = params.fitted_to_context(len(ids), self._max_model_len)
        if len(ids) + params.max_tokens > self._max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                f"context length {self._max_model_len}; shorten the prompt or lower max_tokens",
                "max_tokens", code="context_length_exceeded")
        rid = request_id or uuid.uuid4().hex
        from bullet_ray.engine.stop_checker import IncrementalDetokenizer, TokenIdText

        # a model without a tokenizer (dummy weights) streams its token ids as text: " <id>" per token
        detok = IncrementalDetokenizer(self._tokenizer if self._tokenizer is not None else TokenIdText(), params, ids,
                                       eos_token_ids=self.eos_token_ids)
        target = "prefill" if self.config.is_disaggregated else "hybrid"
        state = RequestState(rid, ids, params, sink or OutputSink(loop), detok, target)  # type: ignore[arg-type]
        with self._lock:
            if rid in self._requests:
                raise InvalidRequest(f"request id {rid!r} is already running", "request_id")
            if self._retired_ids.holds(rid):
                raise InvalidRequest(f"request id {rid!r} was aborted or stopped a moment ago and a worker may still "
                                     f"hold it; use a new id", "request_id")
            self._requests[rid] = state
        return state, AddRequest(rid, ids, params, time.time(), self._max_model_len)

    def _observe_prompts(self, adds: list[AddRequest]) -> None:
        """Count sent prompts in the typical prompt length the predicted TTFT is quoted for."""
        with self._lock:
            for add in adds:
                self._prefill_time.observe_prompt(len(add.prompt_token_ids))

    def stream(self, prompt: Prompt, params: SamplingParams,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        state = self._submit(prompt, params, request_id, None)
        assert state.sink.sync_queue is not None
        finished = False
        try:
            while not finished:
                out = state.sink.sync_queue.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(state.request_id)

    async def stream_async(self, prompt: Prompt, params: SamplingParams,
                           request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's updates as they come. Updates that queued up while the consumer was busy are merged
        into one (a consumer that forwards each update, e.g. over Ray, pays per update, not per token)."""
        state = self._submit(prompt, params, request_id, asyncio.get_running_loop())
        queue = state.sink.async_queue
        assert queue is not None
        finished = False
        try:
            while not finished:
                out = await queue.get()
                while not out.finished and not queue.empty():
                    out = merge_outputs(out, queue.get_nowait())
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(state.request_id)

    # offline ----------------------------------------------------------------------------------------
    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """Run every prompt to completion and return the outputs in the prompts' order (vLLM's offline
        `LLM.generate`). All requests are checked, then sent to the worker in pieces of ~256k prompt tokens, one
        message each; one queue collects every request's updates, so the optional tqdm bar moves as requests finish,
        in whatever order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidRequest(f"{len(plist)} sampling params for {len(prompts)} prompts", "params")
        shared: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        states: list[RequestState] = []
        is_sent = False
        try:
            adds = []
            for prompt, sp in zip(prompts, plist):
                state, add = self._admit(prompt, sp, None, None, sink=_SharedSink(shared))
                states.append(state)
                adds.append(add)
            is_sent = bool(adds)
            for piece in AddRequests.pieces(adds):
                if self._dead_reason is not None:  # a send failed (or a worker died): every request has its error
                    break
                now = time.time()  # arrival: when the worker can first see it, not when the list was checked
                self._send(states[0].location, AddRequests([dataclasses.replace(a, arrival_s=now) for a in piece]))
                self._observe_prompts(piece)
            collected: dict[str, list[RequestOutput]] = {s.request_id: [] for s in states}
            bar = None
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(states), desc="generate", unit="req")
            remaining = len(states)
            while remaining:
                out = shared.get()
                collected[out.request_id].append(out)
                if out.finished:
                    remaining -= 1
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.close()
        except BaseException:  # e.g. a bad prompt in the list (nothing sent yet) or Ctrl-C while they run
            if is_sent:
                self._abort_many([state.request_id for state in states])
            else:
                with self._lock:
                    for state in states:
                        self._requests.pop(state.request_id, None)
            raise
        return [_completion(state, collected[state.request_id]) for state in states]

    # abort ------------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        self._abort_many([request_id])

    # SM split ---------------------------------------------------------------------------------------
    def request_split(self, index: int) -> None:
        """Ask both workers to move to ladder entry `index`; each follows at its next step boundary (the
        side that shrinks first). `split_indexes()` shows where each side is. A move is timed until both sides
        run on it, as the policy's switches are (the `bullet_split_switch_seconds` metric)."""
        size = self.split_ladder_size()
        if not 0 <= index < size:  # an entry past a worker's ladder would never be acked
            raise InvalidRequest(f"split index {index} is outside the ladder [0, {size - 1}]", "split_index")
        self.state.request_switch(index)
        self.num_split_requests += 1
        self._wake_workers()

    def split_ladder_size(self) -> int:
        """Entries a split request may name: the smallest of the workers' ladders (the mps backend's has one)."""
        sizes = [int(info["ladder_size"]) for info in self.worker_info.values() if "ladder_size" in info]
        return min(sizes) if sizes else len(self.ladder_decode_sms)

    def set_slo_targets(self, ttft_s: float, tpot_s: float) -> None:
        """The TTFT/TPOT targets the split decision aims at from its next step on (the controller's push)."""
        if not (ttft_s > 0 and tpot_s > 0):
            raise InvalidRequest(f"targets must be > 0, got ttft {ttft_s} s, tpot {tpot_s} s", "slo_targets")
        self.state.set_slo_targets(ttft_s, tpot_s)

    def set_split_bounds(self, min_decode_sms: int | None, max_decode_sms: int | None) -> tuple[int, int]:
        """Keep decode's SMs within [min_decode_sms, max_decode_sms] (None: unbounded; the cluster controller's
        bounds): the split policy chooses only ladder entries inside, and a split outside moves now. Bounds
        that hold no entry keep the one nearest to them. Only entries every worker's ladder has count (the mps
        backend's has one): the deciding worker would fail on any other. Returns the allowed ladder index range."""
        counts = self.ladder_decode_sms[:self.split_ladder_size()]
        inside = [i for i, c in enumerate(counts) if (min_decode_sms is None or c >= min_decode_sms)
                  and (max_decode_sms is None or c <= max_decode_sms)]
        # not the mixed fallback's whole GPU (a one-entry ladder has nothing else)
        ordinary = [i for i, c in enumerate(counts) if c < self.sm_count] or list(range(len(counts)))
        if not any(i in ordinary for i in inside):  # nothing inside, or only the whole GPU: prefill would starve
            bound = max_decode_sms if max_decode_sms is not None else min_decode_sms
            inside = [min(ordinary, key=lambda i: abs(counts[i] - (bound or 0)))]
        self._split_bounds = (inside[0], inside[-1])
        self.state.set_split_bounds(inside[0], inside[-1])  # the deciding worker keeps its choice inside
        if self.config.is_disaggregated:
            requested = self.split_indexes()["requested"]
            clamped = min(max(requested, inside[0]), inside[-1])
            if clamped != requested:
                self.request_split(clamped)
        return self._split_bounds

    def _wake_workers(self) -> None:
        for role in self._conns:
            self._send(role, Wake())  # an idle worker would otherwise notice only at its next poll

    def drain_step_records(self) -> dict[str, Any]:
        """Per-step records since the last call (at most the state block's ring per side; older ones are
        dropped): {"prefill"/"decode": [(measured_s, predicted_s, ladder index, -1 across a switch)], "switch_s":
        [decision to both sides launching on the new split], "switch_drain_s": [decision to no step left on the
        old split], "handoff_s": [prefill worker's send to the decode worker taking a prefilled sequence]} for the
        metrics (predicted vs measured step time, the switches' and hand-offs' times)."""
        out: dict[str, Any] = {}
        with self._lock:
            for side in (Side.PREFILL, Side.DECODE):
                step, entries = self.state.recent_steps(side, self._drained_steps[side])
                self._drained_steps[side] = step
                out[side.name.lower()] = [(m / 1e6, p / 1e6, i) for m, p, i in entries]
            self._drained_switches, switches = self.state.recent_switches(self._drained_switches)
            self._drained_drains, drains = self.state.recent_drains(self._drained_drains)
        out["switch_s"] = [us / 1e6 for us in switches]
        out["switch_drain_s"] = [us / 1e6 for us in drains]
        handoffs = self._handoffs_undrained
        out["handoff_s"] = [handoffs.popleft() for _ in range(len(handoffs))]  # appended meanwhile: the next call's
        return out

    def split_indexes(self) -> dict[str, int]:
        from bullet_ray.gpu.partition import DECODE_ACK, PREFILL_ACK, REQUESTED

        sw = self.state.switch
        return {"requested": int(sw[REQUESTED]), "prefill": int(sw[PREFILL_ACK]), "decode": int(sw[DECODE_ACK])}

    # health, stats, shutdown ------------------------------------------------------------------------
    def check_health(self) -> None:
        if self._is_shut_down or self._is_draining:
            raise EngineDeadError("the engine is shutting down" if not self._is_shut_down else
                                  "the engine was shut down")
        if self._dead_reason is None:
            for role, handle in self._workers.items():
                if not handle.is_alive():
                    self._mark_dead(f"{role} worker is not alive")
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def stats(self) -> EngineStats:
        self._observe_prefill_step()
        with self._lock:
            located = [s.location if s.location != "hybrid" or s.first_token_s is None else "decode"
                       for s in self._requests.values()]
            queued_tokens = sum(len(s.prompt_token_ids) for s in self._requests.values()
                                if s.location in ("prefill", "hybrid") and s.first_token_s is None)
            predicted_ttft = self._prefill_time.predict_ttft(queued_tokens)
            typical_tokens: int | None = self._prefill_time.typical_prompt_tokens()
            per_token = self._prefill_time.seconds_per_token()
        policy = self.state.read_policy()
        if self.config.uses_split_policy and policy["predicted_ttft_us"] > 0:
            predicted_ttft = policy["predicted_ttft_us"] / 1e6  # the performance model's, from the prefill worker
            typical_tokens = policy["predicted_ttft_tokens"] or None
            per_token = policy["predicted_ttft_ns_per_token"] / 1e9 if policy["predicted_ttft_ns_per_token"] else None
        waiting = sum(1 for loc in located if loc in ("prefill", "hybrid"))
        decode_row = self.state.read(Side.DECODE)
        if self.config.is_disaggregated:  # prefilled but without a decode slot yet (max_num_seqs), or handed
            # over unprefilled (mixed fallback): waiting too, as the decode side last published (at most what
            # it holds now: an idle side's row is not refreshed)
            waiting += min(decode_row["num_queued"], len(located) - waiting)
        recent_decode_step = self._observe_decode_step(decode_row, waiting < len(located))
        prefill_row = self.state.read(Side.PREFILL)
        extra: dict[str, Any] = {"prefill": prefill_row, "decode": decode_row,
                                 "num_graph_captures_serving": self.num_graph_captures_serving}
        # each worker's garbage collections so far, as its last published step left them (a hybrid worker: decode's row)
        extra["gc"] = {role: {"seconds": row["gc_us"] / 1e6, "collections": row["gc_count"]}
                       for role in self._workers for row in [prefill_row if role == "prefill" else decode_row]}
        if self.config.is_disaggregated:
            indexes = self.split_indexes()
            counts = self.ladder_decode_sms
            extra["split"] = {**indexes, "decode_sms_now": counts[min(indexes["decode"], len(counts) - 1)],
                              "prefill_sms_now": self.sm_count - counts[min(indexes["prefill"], len(counts) - 1)],
                              "num_requests": self.num_split_requests + policy["num_switches"],
                              "decode_sms": counts}
            by_reason = {name: n for name, n in zip(_reason_names(), self.state.read_decisions_by_reason()) if n}
            extra["policy"] = policy | {"reason": _reason_name(policy["decision_reason"]), "decisions_by_reason": by_reason}
            # the last 256 hand-offs, prefill's send -> decode takes it (stats() runs often: a short sort)
            hops = sorted(itertools.islice(reversed(self.hop_handoff_s), 256))
            extra["handoff"] = {"way": self.config.handoff, "num_direct": self.num_direct_handoffs,
                                "hop_p50_ms": round(hops[len(hops) // 2] * 1e3, 3) if hops else None,
                                "hop_p99_ms": round(hops[min(len(hops) - 1, int(0.99 * len(hops)))] * 1e3, 3)
                                if hops else None}
        return EngineStats(num_waiting=waiting, num_running=len(located) - waiting,
                           num_kv_blocks=self.allocator.num_blocks, num_free_kv_blocks=self.allocator.num_free,
                           num_preemptions=self.num_preemptions + sum(self._worker_recomputes.values()),
                           predicted_ttft_s=predicted_ttft, predicted_ttft_prompt_tokens=typical_tokens,
                           ttft_per_prompt_token_s=per_token,
                           recent_decode_step_s=recent_decode_step, extra=extra)

    def _observe_decode_step(self, row: dict[str, Any], is_decoding: bool) -> float | None:
        """Wall time per step of the decoding side (or hybrid worker) since the last call, averaged with the
        earlier windows: what a running request's TPOT is now (admission compares it with the TPOT target).
        None while nothing decodes (an idle engine's last steps say nothing about the next ones)."""
        now = time.monotonic()
        with self._lock:
            if not is_decoding:
                self._decode_step_mark, self._decode_step_avg_s = None, None
                return None
            mark = self._decode_step_mark
            if mark is not None and row["step"] > mark[0]:
                per_step = (now - mark[1]) / (row["step"] - mark[0])
                avg = self._decode_step_avg_s
                self._decode_step_avg_s = per_step if avg is None else avg + 0.5 * (per_step - avg)
            if mark is None or row["step"] > mark[0]:
                self._decode_step_mark = (row["step"], now)
            return self._decode_step_avg_s

    @property
    def num_running_requests(self) -> int:
        with self._lock:
            return len(self._requests)

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop the workers and release the runtime folder (shared weights, KV pool). Requests still
        running after `drain_timeout_s` (new ones are refused meanwhile) end with an error output."""
        if self._is_shut_down:
            return
        self._is_draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self.num_running_requests and self._dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        num_failed = self._fail_requests("the engine is shutting down")
        if num_failed:
            logger.warning("engine shut down with %d requests still running; they ended with an error", num_failed)
        self._is_shut_down = True
        for role in list(self._conns):
            try:
                with self._send_locks[role]:
                    self._conns[role].send(Shutdown())
            except OSError:
                pass
        for handle in self._workers.values():
            handle.join(10)
            if handle.is_alive():
                handle.kill()
        self.launcher.close()
        for conn in self._conns.values():
            conn.close()
        for name in ("allocator", "state"):
            obj = getattr(self, name, None)
            if obj is not None:
                obj.close()
        self._listener.close()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        # the watchdog sees the folder gone and exits by itself

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _SharedSink(OutputSink):
    """An output sink that feeds one queue shared by many requests (offline `generate`)."""

    def __init__(self, shared: queue.SimpleQueue[RequestOutput]) -> None:
        super().__init__(None)
        self.shared = shared

    def put(self, output: RequestOutput) -> None:
        self.shared.put(output)


def _completion(state: RequestState, outputs: list[RequestOutput]) -> CompletionOutput:
    """One request's updates folded into its completion (an engine failure shows as finish_reason "error")."""
    token_ids = [t for o in outputs for t in o.token_ids_delta]
    logprobs = [lp for o in outputs for lp in (o.logprobs_delta or [])]
    last = outputs[-1]
    return CompletionOutput(state.request_id, state.prompt_token_ids, token_ids,
                            "".join(o.text_delta for o in outputs), last.finish_reason or "stop",
                            logprobs if state.params.logprobs is not None else None, last.ttft_s, last.e2e_s)


def workers_ladder(worker_info: dict[str, dict], config: EngineConfig, sm_count: int) -> list[int]:
    """The workers' SM ladder (decode SM counts) as the decode worker's partitioner granted them (its Ready info:
    rounded up to the GPU's groups, the mixed fallback's whole-GPU entry included); without a decode worker (the
    chunked schedule's one hybrid worker) the ladder it would have: `config.decode_sm_counts` or the default."""
    from bullet_ray.gpu.partition import default_ladder

    granted = worker_info.get("decode", {}).get("ladder_decode_sms")
    if granted:
        return [int(c) for c in granted]
    counts = config.decode_sm_counts
    ladder = list(counts) if counts is not None else default_ladder(sm_count)
    if config.uses_mixed_fallback:  # the workers' whole-GPU entry past the last (the mixed fallback's)
        ladder.append(sm_count)
    return ladder
