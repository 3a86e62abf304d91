"""The worker's message loop (`WorkerBase`); the role classes supply `handle`, `plan` and `process` (the
process's entry point, `run_worker`, is in `entry.py`).

Every role steps the same way (`WorkerBase.step`): plan step k+1, launch it on the device, then collect
step k (the host learns its sampled ids: stop checks, outputs, freed blocks) while k+1 runs. Without
asynchronous scheduling step k+1 is collected right after its launch. A step launches ahead of the collect
when it runs through CUDA graphs: a decode graph replay, or a step with prompt tokens that piecewise graphs
hold (a few launches per layer). An eager step's launch blocks once the device's launch queue is full
(hundreds of kernels), which on the H100 held the step before's tokens back by most of a step, so the step
in flight is collected first. A role decides that before planning (`next_step_is_eager`: the hybrid
worker, whose plan holds running sequences the collect may finish) or, where collecting cannot change the
planned batch, after (`batch_runs_eagerly`: the prefill worker). Blocks freed while a step is in flight go
back to the shared pool only once it has finished (`DeferredFree`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from bullet_ray.engine.gc_pauses import GcPauses
from bullet_ray.engine.messages import AbortRequests, AddRequests, Shutdown, Wake, WorkerSpec
from bullet_ray.engine.scheduler.base import ScheduledSeq, release
from bullet_ray.engine.scheduler.deferred_free import DeferredFree
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.startup_order import overlaps_startup, tunes_piecewise_buckets, uses_cuda_graphs
from bullet_ray.engine.state_block import Side
from bullet_ray.engine.worker.setup import WorkerResources
from bullet_ray.engine.worker.step_profile import StepProfiler
from bullet_ray.errors import ConfigError

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.5


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, else the machine's count)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else (os.cpu_count() or 1)


def cpu_threads(role: str, num_cpus: int | None, other_busy: bool = True) -> int:
    """Intra-op threads of a CPU worker: the chunked schedule's one worker takes every core; a side of the bullet
    schedule half of them while the other side has work (two processes' threads on the same cores slow both),
    every core while the other side idles (the CPU's split of its cores, as the SM split is the GPU's)."""
    cores = max(1, num_cpus or 1)
    return cores if role == "hybrid" or not other_busy else max(1, cores // 2)


class WorkerBase:
    """Receives messages, runs steps, publishes its row of the state block, sends outputs."""

    role = "base"
    side = Side.PREFILL
    # perf_counter when the last `launch` began and when the last one that returned ended (0: none yet); a switch
    # record places its decision against them (SideWorker.follow_split)
    _launch_began_s = 0.0
    _launch_ended_s = 0.0

    def __init__(self, spec: WorkerSpec, conn: Connection, resources: WorkerResources) -> None:
        from bullet_ray.engine.runner import ModelRunner
        from bullet_ray.engine.sampler import Sampler

        self.spec = spec
        self.config = spec.config
        self.conn = conn
        self.res = resources
        # frees reach the shared pool only after the step that may still write the blocks has finished
        self.allocator = DeferredFree(resources.kv_pool.allocator)
        self.is_async = self.config.is_async_scheduling
        self.inflight: Any = None  # bullet_ray.engine.runner.InFlightStep launched but not collected
        # sequences that sample in an uncollected step, by request id (an abort must reach them too)
        self.awaiting: dict[str, Sequence] = {}
        self._last_stream: Any = None
        self._launching = False  # inside `launch` (a hook between layer groups or decode pieces may collect there)
        self._last_done_s = 0.0
        # garbage collections timed once serving (`run`): each step record says how long the host spent in them
        self.gc_pauses = GcPauses()
        self.graph_capture: dict[str, Any] = {}
        # seconds each part of this worker's start-up took (run_worker adds "resources"); the step log's
        # `startup` record and the Ready message carry them
        self.startup_s: dict[str, float] = {}
        self.eos_token_ids = tuple(resources.handles.eos_token_ids)
        self.runner = ModelRunner(resources.model, resources.backend, Sampler(), self.config.block_size,
                                  resources.device)
        self.is_stopped = False
        cfg = self.config
        # pages the longest sequence the model admits holds: decode graphs' page tables, a step's largest copy
        self.max_blocks_per_seq = (resources.handles.max_model_len + cfg.block_size - 1) // cfg.block_size
        self.profiler = StepProfiler(cfg.profile_dir, cfg.profile_start_step, cfg.profile_num_steps, self.role,
                                     cfg.is_gpu)
        with self._timed("partitions"):
            self.partitioner = self._make_partitioner()
        from bullet_ray.gpu.partition import SplitSwitch

        # the split is requested through the shared state block; this side follows at step boundaries
        self.switch = SplitSwitch(resources.state.switch, self.partitioner.ladder,
                                  overlap=self.config.split_switch == "overlap")
        if spec.attach is None:
            # before run_worker sends the handles: the attaching worker reads these slots as soon as it is built
            self.switch.reset(self.partitioner.current_index)
        self.uses_graphs = uses_cuda_graphs(self.config)
        self.lt_router: Any = None  # engine.prefill_gemm: cublaslt (bullet_ray.engine.lt_gemm)
        if self.role in ("prefill", "hybrid") and cfg.prefill_gemm_mode != "cublas":
            with self._timed("prefill_gemm_tune"):  # before the piecewise buckets are timed and any graph captured
                self._route_prefill_gemm()
        # piecewise graphs' buckets are chosen here (tuned: GEMMs timed), on the creating worker before it sends its
        # handles, so alone on the GPU (the attaching worker starts at them); the captures wait for capture_graphs
        if self.uses_graphs and self.config.piecewise_limit(self.role) > 0:
            with self._timed("piecewise_tune"):  # the buckets (timed GEMMs where tuned); the captures: piecewise_graphs
                self._make_piecewise_graphs()

    def _route_prefill_gemm(self) -> None:
        """engine.prefill_gemm cublaslt / cublaslt-all (auto on a bullet or static prefill worker): time cuBLASLt's
        algorithms for every projection shape on the partitions this side runs on (a prefill worker: those where
        cuBLAS's device-sized grid wastes SM-rounds, `tuned_places`; the chunked schedule's one worker: the whole
        GPU), then route the projections through the winners (bullet_ray.engine.lt_gemm). Alone on the GPU: the
        creating worker does it before it sends its handles. Under the default (auto) a torch without a usable
        libcublasLt keeps cuBLAS with a warning; asked for by name, it fails the start."""
        from tqdm import tqdm

        from bullet_ray.engine import lt_gemm

        ladder = self.partitioner.ladder
        device_sms = torch.cuda.get_device_properties(self.res.device).multi_processor_count
        whole = self.partitioner.side == "both"  # the hybrid worker: every step on the whole GPU, one place
        places = [lt_gemm.Place(self.partitioner.current_index, device_sms, None)] if whole else lt_gemm.tuned_places(
            [(i, ladder[i].prefill_sms, stream) for i, stream in self._graph_partitions()], device_sms)
        is_auto = self.config.prefill_gemm == "auto"
        try:
            routed = lt_gemm.tune_and_route(self.res.model, places, self.config.prefill_gemm_mode,
                                            self.config.max_num_batched_tokens, self.res.device, device_sms, whole,
                                            progress=lambda it: tqdm(it, desc="prefill GEMM algorithms"))
        except ConfigError as e:
            if not is_auto:
                raise
            logger.warning("%s worker: prefill_gemm auto keeps cuBLAS: %s", self.role, e)
            return
        if routed is None:  # no partition where cuBLAS's grid wastes SM-rounds (or no green contexts)
            log = logger.info if is_auto else logger.warning  # the default need not say it on every start
            log("%s worker: prefill_gemm %s has nothing to tune (%d partitions)", self.role,
                self.config.prefill_gemm_mode, len(places))
            return
        self.lt_router, report = routed
        self.graph_capture = {**self.graph_capture, "prefill_gemm": report}
        logger.info("%s worker: prefill GEMMs through cuBLASLt: %s", self.role,
                    {k: v for k, v in report.items() if k != "choices"})

    def capture_graphs(self) -> None:
        """Capture this worker's CUDA graphs (decode, piecewise) and fill the host's pinned-memory cache: the long
        part of a GPU worker's start-up, which `run_worker` calls once the worker is built (and the creating
        worker has sent its handles: the other worker then starts and captures its own graphs meanwhile)."""
        cfg = self.config
        if self.uses_graphs and self.role in ("decode", "hybrid"):
            with self._timed("decode_graphs"):
                self._enable_decode_graphs()
        if self.runner.piecewise is not None:
            with self._timed("piecewise_graphs"):
                self._capture_piecewise_graphs()
        if self.lt_router is not None:  # how many of the captured GEMMs run a tuned algorithm
            self.graph_capture["prefill_gemm"]["calls"] = dict(self.lt_router.calls)
        if cfg.is_gpu:  # no page-locked allocation (a sync with the GPU) in a serving step's copies
            from bullet_ray.engine.transfer import step_copy_bytes, warm_pinned

            with self._timed("warm_pinned"):
                warm_pinned(step_copy_bytes(max(cfg.max_num_batched_tokens, cfg.max_num_seqs), cfg.max_num_seqs,
                                            self.max_blocks_per_seq))

    @contextlib.contextmanager
    def _timed(self, part: str) -> Iterator[None]:
        """Adds the seconds the block takes to `startup_s[part]`."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.startup_s[part] = round(self.startup_s.get(part, 0.0) + time.perf_counter() - started, 3)

    def _enable_decode_graphs(self) -> None:
        """Decode graphs for every batch bucket on every partition this side may run on, captured now:
        none is captured while serving (`DecodeGraphs.num_captures_serving` counts any that would be)."""
        from bullet_ray.engine.cuda_graphs import DecodeGraphs

        bs = self.config.block_size
        graphs = DecodeGraphs(self.res.model, self.res.backend, bs, self.config.max_num_seqs, self.max_blocks_per_seq,
                              self.res.device, scratch_slot=self.res.kv_pool.scratch_slot,
                              pieces=self.config.decode_pieces
                              if self.role == "decode" and self.config.uses_split_policy else 1)
        self.runner.graphs = graphs
        partitions = self._graph_partitions()
        if self.partitioner.side == "decode":  # green-context streams: cuBLAS may be told their SMs
            ladder = self.partitioner.ladder
            graphs.partition_sms = {i: ladder[i].decode_sms for i, stream in partitions if stream is not None}
        for index, stream in partitions:
            graphs.capture_all(index, stream)
        graphs.is_serving = True
        self.graph_capture = {**self.graph_capture, **graphs.capture_report()}  # prefill_gemm's report stays
        if "sm_target" in self.graph_capture:  # its replays were timed beside the creating worker's captures, or alone
            self.graph_capture["sm_target"]["timed_beside_prefill"] = \
                self.spec.attach is not None and overlaps_startup(self.config)
        logger.info("%s worker: decode graphs captured at start: %s", self.role, self.graph_capture)

    def _graph_partitions(self) -> list[tuple[int, Any]]:
        """(ladder index, stream) of every partition this side may run on: every ladder entry where it has
        SMs when the split moves while serving, else the one it runs on (stream None: the whole GPU)."""
        side = self.partitioner.side
        if side == "both" or not self.config.uses_split_policy:
            indexes = [self.partitioner.current_index]
        else:
            ladder = self.partitioner.ladder
            indexes = [i for i, e in enumerate(ladder) if (e.decode_sms if side == "decode" else e.prefill_sms) > 0]
        return [(i, self.partitioner.stream(i, side) if side != "both" else None) for i in indexes]

    def _piecewise_partitions(self) -> list[tuple[int, Any]]:
        """(ladder index, stream) of the partitions this side captures piecewise graphs on: every one it may run
        on (`_graph_partitions`), a decode side only its whole-GPU entry (where the mixed fallback's steps run)."""
        partitions = self._graph_partitions()
        if self.role == "decode":
            partitions = [(i, stream) for i, stream in partitions if i == self.partitioner.whole_index]
        return partitions

    def _make_piecewise_graphs(self) -> None:
        """The runner's piecewise graphs (everything but attention) for steps with prompt tokens, their token
        buckets tuned where this side captures them on one partition (`tunes_piecewise_buckets`); captured later
        (`capture_graphs`)."""
        from bullet_ray.engine.piecewise_graphs import PiecewiseGraphs

        graphs = PiecewiseGraphs(self.res.model, self.config.piecewise_limit(self.role), self.res.device)
        self.runner.piecewise = graphs
        partitions = self._piecewise_partitions()
        if tunes_piecewise_buckets(self.config, self.role, len(partitions)):
            # timed on the partition the graphs are captured on, alone on the GPU: the creating worker tunes before
            # it sends its handles, and an attaching worker that tunes starts only at the creator's Ready
            # (bullet_ray.engine.startup_order)
            graphs.tune(partitions[0][1])
        elif self.config.piecewise_buckets == "tuned":  # where slow row counts fall depends on the SMs a side has
            logger.info("%s worker: fixed piecewise buckets (tuning is per partition; this side captures %d)",
                        self.role, len(partitions))

    def _capture_piecewise_graphs(self) -> None:
        """Every token bucket of the runner's piecewise graphs on every partition this side captures them on, now."""
        graphs = self.runner.piecewise
        for index, stream in self._piecewise_partitions():
            graphs.capture_all(index, stream)
        graphs.is_serving = True
        self.graph_capture = {**self.graph_capture, "piecewise": graphs.capture_report()}
        logger.info("%s worker: piecewise graphs captured at start: %s", self.role, self.graph_capture["piecewise"])

    def _make_partitioner(self) -> Any:
        """This side's SM partitions: green contexts on GPU (bullet, static), bookkeeping only otherwise."""
        from bullet_ray.gpu.partition import make_partitioner

        on_gpu = self.config.is_gpu and self.role != "hybrid"
        side = self.role if self.role in ("prefill", "decode") else "both"
        device = self.res.device.index or 0 if on_gpu else 0
        counts = list(self.config.decode_sm_counts) if self.config.decode_sm_counts is not None else None
        sm_count = None  # the none backend's nominal 132 SMs, unless it keeps books on a GPU: then the GPU's own,
        if on_gpu and self.config.partition == "none":  # as the front reads them from this worker's Ready info
            import torch

            sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        partitioner = make_partitioner(self.config.partition if on_gpu else "none", side, device,  # type: ignore[arg-type]
                                       counts, sm_count)
        want = self.config.static_decode_sms
        if want is None:
            index = len(partitioner.ladder) // 2
        else:
            index = min(range(len(partitioner.ladder)), key=lambda i: abs(partitioner.ladder[i].decode_sms - want))
        partitioner.select(index)
        if self.config.uses_mixed_fallback and side != "both":
            partitioner.add_whole_gpu_entry()  # the mixed fallback's: decode on every SM
        return partitioner

    def follow_split(self, target: int | None = None, site: str = "loop") -> None:
        """At a step boundary: move to the requested ladder entry (`target`: the request the caller already
        read and checked) when the protocol lets this side. In overlap mode the step in flight keeps running on
        the old partition (`launch` orders the next one after it). `site`: where in the worker this boundary is
        (the step log's switch record names the one that completed a switch: SideWorker)."""
        if self.partitioner.side == "both":
            return
        side = self.partitioner.side
        if target is None:
            target = self.switch.requested()  # one read: the ack is for what was finished
        if self.inflight is not None and self.switch.must_finish_step(side, target):
            self._finish_inflight()  # the ack promises this side's SMs are free: no step of ours still runs
        index = self.switch.maybe_switch(side, target)
        if index is not None:
            self.partitioner.select(index)

    # stepping -------------------------------------------------------------------------------------------
    def launch(self, batch: list[ScheduledSeq], num_layer_groups: int = 1, between_groups: Any = None,
               move_pending: Any = None, before_forward: Any = None, before_sample: Any = None) -> Any:
        """Launch a batch on this side's SMs (its green-context stream on GPU) without waiting for it (except
        between layer groups or decode pieces: ModelRunner.launch, which calls `before_forward` once the inputs are
        prepared and `before_sample` once the forward is launched)."""
        self.profiler.tick()  # counts launches: a profiled window's steps are the step log's rows
        stream = self.partitioner.current_stream(self.partitioner.side) if self.partitioner.side != "both" else None
        if stream is not None and self._last_stream is not None and stream != self._last_stream \
                and self.inflight is not None and self.inflight.done is not None:
            stream.wait_event(self.inflight.done)  # a new split: keep stream order with the last step
        self._last_stream = stream
        self.runner.graph_key = self.partitioner.current_index  # graphs keep the partition they were captured on
        # counted launched before the launch: a hook between its layer groups or pieces may collect the step before
        # (DecodeWorker), and a block that collect frees must wait for this step too (DeferredFree)
        self.allocator.on_launch()
        began = time.perf_counter()
        self._launching = True  # a collect inside the launch leaves a step in flight: this one
        self._launch_began_s = began
        try:
            if stream is None:
                step = self.runner.launch(batch, num_layer_groups, between_groups, move_pending, before_forward,
                                          before_sample)
            else:
                with torch.cuda.stream(stream):
                    step = self.runner.launch(batch, num_layer_groups, between_groups, move_pending, before_forward,
                                              before_sample)
        finally:
            self._launching = False
        step.launched_s, step.began_s = time.perf_counter(), began
        self._launch_ended_s = step.launched_s
        for seq in step.sampled:
            self.awaiting[seq.request_id] = seq
        return step

    def collect(self, step: Any) -> Any:
        """Wait for a launched step and learn its tokens; returns the runner's StepResult."""
        result = self.runner.collect(step)
        self.allocator.on_complete()
        sampled: list[Sequence] = step.sampled
        for seq in sampled:
            if self.awaiting.get(seq.request_id) is seq:
                del self.awaiting[seq.request_id]
        return result

    def step(self) -> bool:
        """Plan and launch the next step, then collect the previous one; False when nothing could run
        (e.g. waiting for free KV blocks) and nothing was in flight."""
        if self.inflight is not None and (self.inflight.needs_host_history or self._next_launch_may_block()):
            # penalties read the output ids on the host; an eager step enqueues hundreds of kernels, and
            # its launch blocks once the device's queue is full: the step in flight is learned first, so
            # its tokens do not wait for most of the next step (a graph replay never blocks)
            self._finish_inflight()
        self.wait_to_plan()
        plan_started = time.perf_counter()
        batch = self.plan()
        if not batch:
            if self.inflight is None:
                return False
            self._finish_inflight()
            return True
        planned = time.perf_counter()
        if self.inflight is not None and self.config.is_gpu and self.batch_runs_eagerly(batch):
            self._finish_inflight()
        launch_started, last_done_s = time.perf_counter(), self._last_done_s
        step = self.launch(batch)
        step.host_s.update(plan=planned - plan_started, launch=step.launched_s - launch_started)
        if last_done_s:  # since the last collect: its outputs, messages, the split, this plan
            step.host_s["gap"] = launch_started - last_done_s
        self.after_launch(step)
        previous, self.inflight = self.inflight, step
        if previous is not None:
            self._finish(previous)
        if not self.is_async:
            self._finish_inflight()
        return True

    def _finish_inflight(self) -> None:
        step, self.inflight = self.inflight, None
        if step is not None:
            self._finish(step)

    def _finish(self, step: Any) -> None:
        result = self.collect(step)
        now = time.perf_counter()
        # the GPU ran this step from here: once the step before had finished and it was launched (a launch in layer
        # groups or decode pieces runs while it launches: from its start)
        first = step.began_s if step.num_layer_groups > 1 else step.launched_s
        started = max(first, self._last_done_s)
        self._last_done_s = now
        self.process(result, step, started)
        self.profiler.after_collect(nothing_in_flight=self.inflight is None and not self._launching)

    @property
    def last_done_s(self) -> float:
        """perf_counter when the last collect finished (0: idle since)."""
        return self._last_done_s

    def abort_awaiting(self, request_id: str) -> Sequence | None:
        """Abort a sequence that only an uncollected step holds: its token is dropped, its blocks freed
        (held back until the step finishes)."""
        seq = self.awaiting.pop(request_id, None)
        if seq is not None:
            seq.finish_reason = "abort"
            release(seq, self.allocator)
        return seq

    def _next_launch_may_block(self) -> bool:
        """On GPU, an eager next step (on CPU a launch computes the whole step anyway; launching ahead there
        keeps the asynchronous path exercised)."""
        return self.config.is_gpu and self.next_step_is_eager()

    def runs_eagerly(self, num_decode_seqs: int, max_num_tokens: int = 0) -> bool:
        """Whether a step runs eagerly: a decode-only step of `num_decode_seqs` (max_num_tokens 0) unless a
        decode graph holds it; a step that may carry prompt tokens, up to `max_num_tokens` in all, unless
        piecewise graphs hold that many (one replay per piece, attention launched between them)."""
        if max_num_tokens > 0:
            piecewise = self.runner.piecewise
            return piecewise is None or piecewise.bucket(max_num_tokens) is None \
                or not piecewise.covers(self.partitioner.current_index)
        graphs = self.runner.graphs
        return graphs is None or graphs.bucket(num_decode_seqs) is None

    # role hooks -------------------------------------------------------------------------------------
    def next_step_is_eager(self) -> bool:
        """Whether the next step may run eagerly, asked before it is planned (the step in flight is then
        collected first); default: always."""
        return True

    def batch_runs_eagerly(self, batch: list[ScheduledSeq]) -> bool:
        """Whether a planned batch runs eagerly, asked after planning while a step is in flight (on GPU): the
        step in flight is then collected before the batch launches. Only for roles that plan ahead
        (`next_step_is_eager` False) and whose planned batch the collect cannot change; default: never."""
        return False

    def handle(self, msg: Any) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        """Whether the role holds sequences to run (in-flight steps aside)."""
        raise NotImplementedError

    def num_recomputed(self) -> int:
        """Sequences this worker sent back for recompute on its own so far (StepOutputs.num_recomputed)."""
        return 0

    def plan(self) -> list[ScheduledSeq]:
        """The next batch (blocks allocated); empty when nothing can run now."""
        raise NotImplementedError

    def after_launch(self, step: Any) -> None:  # noqa: B027 - optional hook
        """Bookkeeping right after a launch (before the previous step is collected)."""

    def process(self, result: Any, step: Any, started_s: float) -> None:
        """Outputs of a collected step: stop checks, messages, freed blocks, the state-block row."""
        raise NotImplementedError

    def wait_to_plan(self) -> None:
        """Called before planning while a step may be in flight; a role may wait here, taking messages."""

    def idle_wait_s(self) -> float:
        """How long an idle worker waits for a message before it looks at its work again."""
        return _IDLE_WAIT_S

    def on_idle(self) -> None:
        """Called when this worker has nothing queued and nothing in flight, before it waits for messages."""

    def abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def inbox(self) -> list[Connection]:
        """Connections besides the front's that bring this worker messages (the decode worker's hand-off socket)."""
        return []

    def receive(self, conn: Connection) -> Any:
        """The next message on `conn` (None: nothing to dispatch)."""
        return conn.recv()

    def close(self) -> None:
        """At the worker's end, before its shared resources are closed."""
        self.profiler.close()
        if self.lt_router is not None:
            logger.info("%s worker: prefill GEMM calls %s", self.role, self.lt_router.calls)
            self.lt_router.close()
            self.lt_router = None

    # loop -------------------------------------------------------------------------------------------
    def ready(self, timeout: float) -> Connection | None:
        """A connection with a message, waiting up to `timeout` (the front's first when several have one)."""
        extra = self.inbox()
        if not extra:
            return self.conn if self.conn.poll(timeout) else None
        ready = wait([self.conn, *extra], timeout)
        if not ready:
            return None
        return self.conn if self.conn in ready else ready[0]  # type: ignore[return-value]

    def run(self) -> None:
        self.gc_pauses.install()
        try:
            self._loop()
        finally:
            self.gc_pauses.uninstall()

    def _loop(self) -> None:
        while not self.is_stopped:
            timeout = 0.0 if self.has_work() or self.inflight is not None else self.idle_wait_s()
            if timeout:
                self._last_done_s = 0.0  # idle: the next step's gap would count the wait, not host work
                self.on_idle()
                if self.has_work():  # e.g. a split requested while it marked itself idle (the requester saw it
                    timeout = 0.0    # active and sent no wake): do not sleep on the messages. Two processes'
                    # stores without a fence leave a window of a few instructions, where the poll's timeout bounds it
            while not self.is_stopped:
                conn = self.ready(timeout)
                if conn is None:
                    break
                msg = self.receive(conn)
                if msg is not None:
                    self.dispatch(msg)
                timeout = 0.0
            self.follow_split()
            if self.is_stopped or not (self.has_work() or self.inflight is not None):
                continue
            if not self.step():
                # blocked on memory: wait for the other side to free blocks or for a message
                self.ready(self.config.idle_poll_ms / 1000)

    def dispatch(self, msg: Any) -> None:
        """One message from the front: shutdown, aborts, a wake (the split), else the role's own (`handle`)."""
        if isinstance(msg, Shutdown):
            self.is_stopped = True
        elif isinstance(msg, AbortRequests):
            self.abort(msg.request_ids)
        elif isinstance(msg, Wake):
            pass  # the loop follows the shared state block right after its messages
        elif isinstance(msg, AddRequests):
            for add in msg.requests:
                self.handle(add)
        else:
            self.handle(msg)

    def publish(self, num_seqs: int, num_tokens: int, num_context_tokens: int, started_s: float,
                num_queued: int, split_index: int | None = None) -> None:
        """This side's row after a collected step; `split_index`: the ladder entry the step ran on (default:
        the current one; in overlap mode the side may have moved on since the launch)."""
        index = self.partitioner.current_index if split_index is None else split_index
        self.res.state.publish(self.side, num_seqs=num_seqs, num_tokens=num_tokens,
                               num_context_tokens=num_context_tokens,
                               step_time_us=int((time.perf_counter() - started_s) * 1e6),
                               num_queued=num_queued, split_index=index, gc_us=int(self.gc_pauses.total_s * 1e6),
                               gc_count=self.gc_pauses.num_collections)
