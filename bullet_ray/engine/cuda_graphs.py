"""CUDA graphs for pure-decode batches: one graph per (SM partition, batch-size bucket).

The workers capture every bucket of every partition they may run on at start (`capture_all`); once
`is_serving` is set, a capture that still happens (a plan never seen at start) is counted in
`num_captures_serving`, which tests and benchmarks read. The decode worker and the chunked schedule's
decode-only steps use the same graphs.

A decode step is hundreds of small kernels; replaying a captured graph removes their launch cost. A batch
is padded up to its bucket (`BUCKETS`, up to the first one >= max_num_seqs). Padding rows repeat the batch's
first sequence's token and position and read no other sequence's blocks; their outputs are dropped. Each
attends over ONE token of that sequence (the first slot of its last page, `padded_rows`), so from the second
layer on its K/V differ from row 0's. They write them to the pool's scratch slot (`scratch_slot`: a block
the allocator never hands out, `KVPool.scratch_slot`), one scatter per layer for the whole batch. Without a
scratch slot (a pool made outside KVPool) they write row 0's slot, and inside a graph of more than one row
row 0's K/V are written after the other rows' (one more small kernel per layer,
`flashinfer_backend.store_first_row_last`), since in one scatter it is undefined which of the duplicate
writes stays, and row 0 could read, and keep in the cache, a padding row's K/V for its own token: the
cause of the graph-vs-eager failures with tensor-core decode in the sixth session, and on the H100 on
2026-11-24 with the CUDA-core kernel too (benchmarks/results/decode_tc_on_h100). Until the fifth session
padding rows read row 0's whole context, so a batch of 35 in the 64 bucket read 29 extra copies of the first sequence's KV every step (5 GB at
1.3k tokens of Llama-3.1-8B, ~1.7 ms on the H100). Padding rows still cost their share of the GEMMs,
norms and sampling, and the bigger bucket's kernels: on the H100 a step of 65-72 sequences took 12.9 ms in
the 128 bucket against 10.9 ms for 57-64 in the 64 bucket, 129-140 took 24.0 against 17.0 ms
(benchmarks/results/serve_h100_m2f). So the buckets double up to 16, then step by 8 up to 64, by 16 up to 128,
by 32 up to 256, by 64 up to 512 and by 128 up to 1,024 (past 32 at most 25% padding rows): a step of 65
sequences pads to 80, not 128. Buckets past 256 exist for offline runs at vLLM's 1,024 sequences: until the
tenth session a decode step of more sequences than 256 ran through the piecewise graphs with eager attention
between them, 47.7 ms median for 359 sequences at 1.25k context against ~33 ms for its KV reads and GEMMs at
the decode graphs' bandwidth (benchmarks/results/serve_h100_m2j/offline_launch.txt). A worker captures only
the buckets up to its `max_num_seqs` (serving configs run 256).

flashinfer's decode wrapper runs in CUDA-graph mode with fixed index buffers refilled before each replay
(`_stage`), with the backend's kernel (CUDA-core, or tensor-core with `decode_tensor_cores`). In that mode
the launch shape depends on the batch size alone, not on the context lengths, for either kernel, so one
graph per bucket serves every step: the CUDA-core kernel's plan pads its grid to a fixed size; the
tensor-core one (flashinfer 0.7.2's prefill plan, `PrefillSplitQOKVIndptr`) splits the KV as it chooses
below `SPLIT_KV_MAX_ROWS` rows, sizes its query tiles from the row count, pads its grid to
max(2 * SMs / KV heads, tiles) CTAs with a valid-block mask, and keeps the KV chunk size, the work lists and
the row count in its workspace (copied by each plan), reading qo_indptr from a buffer the wrapper allocates
once. From `SPLIT_KV_MAX_ROWS` rows a step plans either without a split or with the backend's balanced one
(`decode_plan_options`: only the longest rows, in chunks that fit the padded grid), so such a bucket has two
graphs (`plan_variants`), both captured at start (only where a split fits the workspace and the grid:
`split_chunk_cap`); a bucket whose plan still refuses a split plans without one from then on
(`unsplit_buckets`). The plan's own description is
still part of the key: should a plan ever come out different, a new graph is captured rather than a stale
one replayed (`num_captures` counts every capture, a tuned bucket's discarded one too). A step's page tables
reach the graph's buffers in one copy from pinned staging memory, and flashinfer's plan runs again only when its
work list can differ from the bucket's last one (`plan_key`): never, for an unsplit tensor-core bucket, so in
one-step-at-a-time decoding the host does not spend each step re-planning a schedule it already holds.

With `pieces` > 1 (EngineConfig.decode_pieces) a step is captured as that many graphs of consecutive layers
(`StepGraph`; the first embeds, the last applies the final norm), which pass the hidden states and residual through
static buffers every bucket and partition shares, so a step may run its first pieces on one partition and the rest
on another. `run` with a `between` hook launches them just in time: piece i once piece i - 2 has finished (the GPU
keeps one piece queued), after the hook has had its say (a decode side follows a requested split there, and learns
the step before at the first boundary). A switch then waits for the piece running and the one queued, not for a
whole step.

Graphs keep the SM partition of the stream they were captured on, so each partition (`partition_key`,
the ladder index of the worker's side) gets its own set. On a partition smaller than the GPU (`partition_sms`,
set by the decode worker) each bucket is captured twice, with cuBLAS(Lt) aimed at the partition's SMs and
without, and the faster replay is kept (bullet_ray.engine.gemm_target; `sm_target_choices` records each).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bullet_ray.engine import gemm_target
from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata
from bullet_ray.engine.attention.flashinfer_backend import (
    DirectDecodePlan,
    WriteIndexBuffers,
    default_decode_plan,
)
from bullet_ray.engine.layerwise import group_bounds

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512,
           640, 768, 896, 1024)


class CaptureStream:
    """Where to capture: the current stream when it is a partition's, else one side stream (capture needs a
    non-default stream; one for every capture, since cuBLAS keeps a workspace per stream). `get` also
    makes it wait for the current stream's work."""

    def __init__(self) -> None:
        self._side: Any = None

    def get(self) -> Any:
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():
            if self._side is None:
                self._side = torch.cuda.Stream()
            stream = self._side
        stream.wait_stream(torch.cuda.current_stream())
        return stream


# page-locked staging buffers used in turn; a slot is rewritten only once its last copy ran (its event), so
# the host may run up to STAGING_SLOTS - 1 steps ahead of the GPU without waiting
STAGING_SLOTS = 3


class MetaLayout:
    """Where a decode graph's page tables sit in one int32 buffer of `size` elements: indptr [max_batch + 1],
    last-page lengths [max_batch] and page indices [max_indices], each from a 64-element (256-byte) boundary."""

    ALIGN = 64

    def __init__(self, max_batch: int, max_indices: int) -> None:
        self.max_batch = max_batch
        self.last_at = _round_up(max_batch + 1, self.ALIGN)
        self.indices_at = _round_up(self.last_at + max_batch, self.ALIGN)
        self.size = self.indices_at + max_indices

    def views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, last-page lengths, page indices) views of `buf`."""
        return (buf[:self.max_batch + 1], buf[self.last_at:self.last_at + self.max_batch], buf[self.indices_at:])


def _round_up(x: int, to: int) -> int:
    return (x + to - 1) // to * to


def _page_lock(owner: object, tensors: list[torch.Tensor], pending: list[Any]) -> None:
    """Page-lock `tensors` (host memory) with cudaHostRegister, for as long as `owner` lives (then unregistered
    once the copies `pending` holds the events of have run). Not torch's
    pinned memory (`pin_memory`): its caching allocator records an event on every stream a block was copied on
    when the block is freed, and that aborts the process when the stream's green context was destroyed
    first (a partition closed before the graphs are dropped)."""
    cudart = torch.cuda.cudart()
    for i, t in enumerate(tensors):
        err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 1)  # cudaHostRegisterPortable
        if int(err) != 0:
            _page_unlock(tensors[:i], [])
            raise RuntimeError(f"cudaHostRegister failed ({err}) for {t.numel() * t.element_size()} bytes")
    weakref.finalize(owner, _page_unlock, tensors, pending)


def _page_unlock(tensors: list[torch.Tensor], pending: list[Any]) -> None:
    """Unregister `tensors` once the copies still queued from them (`pending` events) have run."""
    for event in pending:
        if event is not None:
            try:
                event.synchronize()
            except Exception:  # noqa: BLE001 - a context already gone: nothing of it is still queued
                pass
    cudart = torch.cuda.cudart()
    for t in tensors:
        cudart.cudaHostUnregister(t.data_ptr())


def _record() -> Any:
    event = torch.cuda.Event()
    event.record()
    return event


def plan_key(options: dict[str, Any], counts: list[int], tensor_cores: bool,
             backend: str = "fa2") -> tuple[Any, ...] | None:
    """What a graph bucket's decode plan (flashinfer's work list) depends on, given its `options` and each
    row's page count: two steps with equal keys get equal plans, so the second reuses the first's.

    flashinfer 0.7.2's tensor-core plan (`PrefillSplitQOKVIndptr`) reads the query indptr (one token a row)
    and the page indptr, never the last-page lengths or the page indices (the kernel reads those from the
    wrapper's buffers as it runs); without a split every row is one work item whatever its length, so an
    unsplit plan depends on the bucket alone. A split (balanced or flashinfer's own) and the CUDA-core
    kernel's plan (which ignores `disable_split_kv`) depend on the page counts too. None (re-plan every step)
    for a tensor-core wrapper on another backend than fa2: fa3's plan reads the KV lengths in tokens (fp8 KV
    would pick it), which the last-page lengths change every step."""
    if tensor_cores and backend != "fa2":
        return None
    opts = tuple(sorted(options.items()))
    if tensor_cores and options.get("disable_split_kv"):
        return (opts,)
    return (opts, tuple(counts))


def padded_rows(tables: list[list[int]], seq_lens: list[int], b: int) -> tuple[list[list[int]], list[int]]:
    """The page lists and lengths of a bucket-b batch: the real rows, then padding rows that each see one
    token (the first slot of the first row's last page: written, since that page holds the row's tokens
    from its first slot on). Padding rows write the scratch slot, or row 0's, whose own write is then issued
    last (module docstring)."""
    pad = b - len(tables)
    return list(tables) + [tables[0][-1:]] * pad, list(seq_lens) + [1] * pad


# called between two pieces of a decode step, once the piece before the last launched one has finished (or a split
# was requested while the host waited for it: MovePending); returns the partition key and stream the next pieces run
# on (the stream None: the current one)
BetweenPieces = Callable[[], tuple[Any, Any]]
MovePending = Callable[[], bool]  # polled while the host waits for a piece: a split was requested meanwhile


def _wait_unless(event: Any, move_pending: MovePending) -> tuple[bool, float]:
    """Wait for `event` unless `move_pending` turns true first (polled between queries, the GIL yielded each turn);
    (True when the wait was cut short, the longest time in seconds between two looks at `move_pending` or from the
    wait's start to the first: a poll held up by the event query or by another thread shows there)."""
    last = time.perf_counter()
    longest = 0.0
    while not event.query():
        now = time.perf_counter()
        longest = max(longest, now - last)
        last = now
        if move_pending():
            return True, longest
        time.sleep(0)
    return False, max(longest, time.perf_counter() - last)


class StepGraph:
    """A captured decode step: one CUDA graph of the whole forward, or one per piece of consecutive layers
    (`DecodeGraphs.pieces`); `out` is the final hidden states (the last piece's output)."""

    def __init__(self, pieces: list[torch.cuda.CUDAGraph], out: torch.Tensor) -> None:
        self.pieces, self.out = pieces, out

    def replay(self) -> None:
        for graph in self.pieces:
            graph.replay()


def graph_buckets(max_num_seqs: int) -> list[int]:
    """The batch-size buckets for a worker that runs at most `max_num_seqs` sequences per step."""
    top = next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
    return [b for b in BUCKETS if b <= top]


class DecodeGraphs:
    def __init__(self, model: Any, backend: Any, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, scratch_slot: int | None = None, pieces: int = 1) -> None:
        """`scratch_slot`: a slot of the KV pool no sequence owns (`KVPool.scratch_slot`), where padding rows
        write their K/V: one scatter per layer. None: they write row 0's slot, and row 0 writes after them (a
        second scatter per layer: `store_first_row_last`). `pieces`: graphs per step (layer ranges, at most one
        per layer; 1: the whole forward in one)."""
        import flashinfer

        self._flashinfer = flashinfer
        self.model, self.backend = model, backend
        self.block_size = block_size
        self.scratch_slot = scratch_slot
        self.buckets = graph_buckets(max(1, max_num_seqs))
        self.max_batch = self.buckets[-1]
        n, dev = self.max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)
        # the wrappers' page tables in ONE device buffer (indptr, last-page lengths, page indices at aligned
        # offsets), filled by one copy a step from a ring of pinned staging buffers laid out the same way
        self._layout = MetaLayout(n, n * max_blocks_per_seq)
        self._meta = torch.zeros(self._layout.size, dtype=torch.int32, device=dev)
        self.indptr, self.last_len, self.indices = self._layout.views(self._meta)
        self._staging = [torch.zeros(self._layout.size, dtype=torch.int32) for _ in range(STAGING_SLOTS)]
        self._staged: list[Any] = [None] * STAGING_SLOTS  # the event after each slot's last copy
        _page_lock(self, self._staging, self._staged)
        self._next_slot = 0
        # per bucket: (what its plan's work list depends on, the plan's description) of the wrapper's last plan
        self._last_plan: dict[int, tuple[tuple[Any, ...], tuple[int, ...]]] = {}
        self.num_plans = 0  # flashinfer plans made
        self.num_plans_reused = 0  # steps whose plan was the bucket's last one (flashinfer's plan skipped)
        self.num_plans_direct = 0  # plans made by the wrapper's compiled planner directly (`_plan_wrapper`)
        be = backend
        self._direct_plan = (DirectDecodePlan(be.num_heads, be.num_kv_heads, be.head_dim, block_size)
                             if default_decode_plan() == "direct" else None)
        self.wrappers: dict[int, Any] = {}
        self.unsplit_buckets: set[int] = set()  # buckets whose plan refused a balanced split (`_plan`)
        self.graphs: dict[tuple[Any, ...], StepGraph] = {}
        self.bounds = group_bounds(model.num_layers, max(1, pieces))  # a layer-wise prefill's rule
        self.pieces = len(self.bounds)
        # what one piece hands the next (hidden states, residual), shared by every bucket and partition; made at
        # the first capture in pieces (the model's hidden size and dtype from its embedding)
        self._carry: tuple[torch.Tensor, torch.Tensor] | None = None
        self._write_index: WriteIndexBuffers | None = None  # the K/V write index the pieces share (with the carry)
        self.num_piece_moves = 0  # steps that moved to another partition between two of their pieces
        self.num_piece_waits_cut = 0  # waits for a piece cut short by a requested split (`_run_pieces`)
        self.last_move_piece: int | None = None  # the first boundary (piece index) where the last step in pieces moved
        self.last_poll_gap_s = 0.0  # the last step in pieces: the longest gap between its looks at a requested split
        # the last step: host seconds from `run`'s start to its first replay, the plan's (and graph lookup's) part, and
        # the part of that spent waiting for the GPU (a staging slot's copy of two steps ago, flashinfer's plan fence)
        self.last_setup_s = self.last_plan_s = self.last_wait_s = 0.0
        self._wait_s = 0.0  # the host's waits for the GPU since `run` began
        self.num_piece_moves_missing = 0  # moves to a partition without this step's graph (none captured mid-step)
        self.num_captures = 0
        self.num_captures_serving = 0  # captures after is_serving was set (should stay 0)
        self.is_serving = False
        self.capture_s = 0.0  # time spent capturing at start
        self.capture_bytes = 0  # device memory the start-up captures took (allocated by torch)
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_stream = CaptureStream()
        # SMs of each partition smaller than the GPU (partition_key -> SMs): its buckets are captured with and
        # without a cuBLAS SM target, the faster kept; (partition_key, bucket) -> (plain ms, targeted ms, kept)
        self.partition_sms: dict[Any, int] = {}
        self.tune_sm_target = gemm_target.tuning_enabled()
        self.device_sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.sm_target_choices: dict[tuple[Any, int], tuple[float, float, bool]] = {}

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds `num_seqs` sequences; None when the batch is too large for graphs."""
        return next((b for b in self.buckets if b >= num_seqs), None)

    def _wrapper(self, b: int) -> Any:
        if b not in self.wrappers:
            self.wrappers[b] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.backend.workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=self.backend.decode_tensor_cores,
                paged_kv_indptr_buffer=self.indptr[:b + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_len[:b])
        return self.wrappers[b]

    def _plan(self, b: int, tables: list[list[int]], seq_lens: list[int],
              options: dict[str, Any] | None = None) -> tuple[int, ...]:
        """Plan the bucket-b wrapper (padding rows: `padded_rows`) with the backend's options for these rows
        (`decode_plan_options`: e.g. a balanced split) unless `options` are given; returns the plan's
        description.

        The page tables (indptr, last-page lengths, page indices) go to the graph's buffers in one asynchronous
        copy from a pinned staging buffer; flashinfer's plan (its work list, copied to the wrapper's own
        workspace) runs only when it can come out different from the wrapper's last one (`plan_key`): a step
        of an unsplit tensor-core bucket, or of a split one whose rows span the same page counts, reuses it.
        Nothing here waits for the GPU but a staging slot whose copy of two steps ago has not run yet (and
        flashinfer's plan fence), so this step is planned while the previous one still runs."""
        rows, lens = padded_rows(tables, seq_lens, b)
        counts = [len(r) for r in rows]
        be, wrapper = self.backend, self._wrapper(b)
        if options is None:
            options = {"disable_split_kv": True} if b in self.unsplit_buckets else be.decode_plan_options(counts, graph_rows=b)
        indptr, last, total = self._stage(b, rows, lens, counts)
        kernel = (wrapper.use_tensor_cores, getattr(wrapper, "_backend", "fa2"))  # what plan_key reads of it
        key = plan_key(options, counts, *kernel)
        last_plan = self._last_plan.get(b)
        if key is not None and last_plan is not None and last_plan[0] == key:
            self.num_plans_reused += 1
            return last_plan[1]
        args = (wrapper, indptr, self.indices[:total], last, be.num_heads, be.num_kv_heads, be.head_dim,
                self.block_size)
        kwargs = {"q_data_type": be.kv_cache.dtype, "kv_data_type": be.kv_cache.dtype, "sm_scale": be.scale}
        self._last_plan.pop(b, None)  # a failed plan leaves the wrapper's workspace unknown
        try:
            self._plan_wrapper(wrapper, args, kwargs, options, indptr, last)
        except Exception as e:  # noqa: BLE001 - flashinfer's refusal (a tvm-ffi error); a second failure raises
            if "fixed_split_size" not in options:
                raise
            # the bucket cannot take a split (its partial outputs outgrow the workspace, or more chunks than its
            # padded grid): its steps go without one from now on
            logger.warning("decode graphs: bucket %d plans without split-KV (%s)", b, str(e).splitlines()[0][:160])
            self.unsplit_buckets.add(b)
            options = {"disable_split_kv": True}
            key = plan_key(options, counts, *kernel)
            self._plan_wrapper(wrapper, args, kwargs, options, indptr, last)
        self._staged[(self._next_slot - 1) % STAGING_SLOTS] = _record()  # flashinfer's copies read the slot too
        info = getattr(wrapper, "_plan_info", None)
        plan = tuple(int(x) for x in info) if info is not None else ()
        if key is not None:
            self._last_plan[b] = (key, plan)
        return plan

    def _plan_wrapper(self, wrapper: Any, args: tuple[Any, ...], kwargs: dict[str, Any], options: dict[str, Any],
                      indptr: torch.Tensor, last: torch.Tensor) -> None:
        """One flashinfer plan of a bucket's wrapper behind the backend's plan fence: by its compiled planner directly
        where `BULLET_RAY_DECODE_PLAN=direct` and the wrapper allows (`DirectDecodePlan.serves`: after its first
        plan), else by the wrapper's `plan`."""
        fence = self.backend.fence
        self.num_plans += 1
        if self._direct_plan is not None and DirectDecodePlan.serves(wrapper):
            self.num_plans_direct += 1
            self._wait_s += fence.plan_by(wrapper, functools.partial(self._direct_plan, wrapper, indptr, last, **options))
        else:
            self._wait_s += fence.plan(*args, **kwargs, **options)

    def _stage(self, b: int, rows: list[list[int]], lens: list[int],
               counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Copy a bucket-b batch's page tables to the graph's buffers (one copy from the next pinned staging
        slot, once the GPU has taken that slot's previous copy); returns the slot's pinned indptr and
        last-page lengths (what flashinfer's plan reads on the host) and the number of page indices."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % STAGING_SLOTS
        if self._staged[slot] is not None:
            waited = time.perf_counter()
            self._staged[slot].synchronize()
            self._wait_s += time.perf_counter() - waited
        host = self._staging[slot]
        indptr_h, last_h, indices_h = self._layout.views(host)
        view = indptr_h[:b + 1].numpy()
        view[0] = 0
        np.cumsum(counts, out=view[1:])
        total = int(view[-1])
        last_h[:b].numpy()[:] = (np.asarray(lens, dtype=np.int32) - 1) % self.block_size + 1
        indices_h[:total].numpy()[:] = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int32, count=total)
        end = self._layout.indices_at + total
        self._meta[:end].copy_(host[:end], non_blocking=True)
        self._staged[slot] = _record()
        return indptr_h[:b + 1], last_h[:b], total

    def plan_variants(self, b: int) -> list[dict[str, Any] | None]:
        """The plan options a bucket's steps may take, each captured at start (None: the backend's default for
        rows of one page): from `decode_split_kv_rows` rows on a step plans either without a split or with a
        balanced one (`decode_plan_options`), two graphs."""
        be = self.backend
        limit = be.decode_split_kv_rows
        if not getattr(be, "decode_tensor_cores", False) or not limit or b < limit or be.split_chunk_cap(b) <= b:
            return [None]  # no split here, or none that fits (every row takes a chunk; a split needs one more)
        return [{"disable_split_kv": True}, {"fixed_split_size": 1}]

    def _capture(self, b: int) -> StepGraph:
        """Capture the forward of the current (already planned and filled) bucket-b batch."""
        md = AttentionMetadata(query_start_loc=self.indptr[:b + 1], seq_lens=self.last_len[:b],
                               block_tables=self.indices[:b].view(b, 1), slot_mapping=self.slots[:b],
                               query_lens_list=[1] * b, seq_lens_list=[1] * b, block_size=self.block_size,
                               is_decode=True)
        be = self.backend
        saved = be.decode
        be.decode = self._wrapper(b)
        be._is_decode = True
        # no scratch slot: padding rows write row 0's slot, so row 0 writes last
        be.first_row_writes_last = b > 1 and self.scratch_slot is None
        try:
            stream = self._capture_stream.get()
            ctx = AttentionContext(be, md)
            with torch.cuda.stream(stream):  # warm-ups rewrite the same K/V into the same slots: harmless
                for _ in range(2):
                    be.forget_batch()
                    self.model.forward(self.input_ids[:b], self.positions[:b], ctx)
            be.forget_batch()  # the K/V rows must be computed inside the graph, from the static slot buffer
            if self.pieces == 1:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    out = self.model.forward(self.input_ids[:b], self.positions[:b], ctx)
                step = StepGraph([graph], out)
            else:
                step = self._capture_pieces(b, ctx, stream)
            # a graph's first launch costs more than the next ones (its upload to the device): paid here, at start,
            # not by the first served step of this bucket and plan (serve_h200_m20: such first uses ran up to 5.4 /
            # 9.7 ms over the model's prediction with 1 / 8 pieces, one of them, on a move between 32 pieces, 227 ms)
            with torch.cuda.stream(stream):
                step.replay()
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            be.decode = saved
            be.first_row_writes_last = False
            be.forget_batch()
        return step

    def _capture_pieces(self, b: int, ctx: AttentionContext, stream: Any) -> StepGraph:
        """One graph per piece of layers, in order on one pool: each reads and writes the shared carry buffers (the
        first embeds, the last returns the final norm's output). The first piece derives the batch's K/V write index
        into buffers outside the pool (`WriteIndexBuffers`), where the later pieces read it, whichever partition's
        graphs they are: kept in this partition's pool, a step that moved here after another partition's first piece
        would write through an index no kernel of this step has filled."""
        if self._carry is None:
            with torch.cuda.stream(stream):
                h = self.model.embed(self.input_ids[:1])
            self._carry = (torch.zeros(self.max_batch, h.shape[-1], dtype=h.dtype, device=h.device),
                           torch.zeros(self.max_batch, h.shape[-1], dtype=h.dtype, device=h.device))
            self._write_index = WriteIndexBuffers(self.max_batch, h.device)
            torch.cuda.current_stream().wait_stream(stream)
        be = self.backend
        be.write_index_buffers = self._write_index
        hidden, residual = self._carry[0][:b], self._carry[1][:b]
        graphs, out = [], None
        try:
            for i, (start, end) in enumerate(self.bounds):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    h_in, r_in = (self.model.embed(self.input_ids[:b]), None) if i == 0 else (hidden, residual)
                    h, r = self.model.forward_layers(h_in, r_in, self.positions[:b], ctx, start, end)
                    if i == len(self.bounds) - 1:
                        out = self.model.final_norm(h, r)
                    else:
                        if h.data_ptr() != hidden.data_ptr():
                            hidden.copy_(h)
                        if r is not None and r.data_ptr() != residual.data_ptr():
                            residual.copy_(r)
                graphs.append(graph)
        finally:
            be.write_index_buffers = None
        assert out is not None
        return StepGraph(graphs, out)

    @torch.inference_mode()
    def capture_all(self, partition_key: Any, stream: Any = None) -> None:
        """Capture every bucket for one partition (on its stream) with a dummy batch: every row is one
        token at position 0 of block 0 (the pool is unused at start; a real step rewrites any slot it
        reads)."""
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for b in self.buckets:
                self.input_ids[:b].zero_()
                self.positions[:b].zero_()
                # the dummy K/V: the scratch block, else block 0
                self.slots[:b].fill_(0 if self.scratch_slot is None else self.scratch_slot)
                for options in self.plan_variants(b):
                    # a split variant: row 0 over two pages (block 0 twice) in chunks of one page
                    tables, lens = ([[0, 0]] + [[0]] * (b - 1), [self.block_size + 1] + [1] * (b - 1)) \
                        if options is not None and "fixed_split_size" in options else ([[0]] * b, [1] * b)
                    plan = self._plan(b, tables, lens, options)
                    key = (partition_key, b, plan)
                    if key not in self.graphs:
                        sms = self.partition_sms.get(partition_key)
                        if self.tune_sm_target and sms is not None and sms < self.device_sms:
                            self.graphs[key] = self._capture_tuned(partition_key, b, sms)
                        else:
                            self.graphs[key] = self._capture(b)
                            self.num_captures += 1
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        self.capture_bytes += torch.cuda.memory_allocated() - before

    def _capture_tuned(self, partition_key: Any, b: int, sms: int) -> StepGraph:
        """Capture bucket b without and with cuBLAS aimed at the partition's `sms`; keep the faster replay.
        A bucket's later plan variants (the split-KV graph) reuse its first choice (the GEMMs are the same)."""
        if (partition_key, b) in self.sm_target_choices:
            self.num_captures += 1
            return self._capture_as_chosen(partition_key, b)
        plain = self._capture(b)
        plain_ms = self._replay_ms(plain)
        self.num_captures += 1
        try:
            with gemm_target.sm_target(sms, self.device_sms):
                targeted = self._capture(b)
        except Exception:  # noqa: BLE001 - a cuBLASLt capture this model cannot take: the plain graph serves
            logger.warning("decode graph with cuBLAS's SM target failed (partition %s, bucket %d): kept the plain one",
                           partition_key, b, exc_info=True)
            self.sm_target_choices[(partition_key, b)] = (round(plain_ms, 4), float("nan"), False)
            return plain
        targeted_ms = self._replay_ms(targeted)
        self.num_captures += 1
        keep = gemm_target.keeps_target(plain_ms, targeted_ms)
        self.sm_target_choices[(partition_key, b)] = (round(plain_ms, 4), round(targeted_ms, 4), keep)
        return targeted if keep else plain

    def _capture_as_chosen(self, partition_key: Any, b: int) -> StepGraph:
        """Capture bucket b the way this partition's tuning chose for it (no choice: plain); never re-timed."""
        choice = self.sm_target_choices.get((partition_key, b))
        if choice is None or not choice[2]:
            return self._capture(b)
        with gemm_target.sm_target(self.partition_sms[partition_key], self.device_sms):
            return self._capture(b)

    def _replay_ms(self, graph: StepGraph, repeats: int = 3) -> float:
        """Mean device time of a replay on the capture stream (the partition's); `graph` comes from `_capture`,
        which replayed it once there already: the warm-up."""
        stream = self._capture_stream.get()
        with torch.cuda.stream(stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / repeats

    def capture_report(self) -> dict[str, Any]:
        report = {"num_graphs": len(self.graphs), "pieces": self.pieces, "buckets": list(self.buckets),
                  "num_piece_moves_missing": self.num_piece_moves_missing,
                  "capture_s": round(self.capture_s, 3),
                  "capture_mb": round(self.capture_bytes / 2**20, 1),
                  "num_captures_serving": self.num_captures_serving,
                  "decode_plan": "wrapper" if self._direct_plan is None else "direct"}
        if self.sm_target_choices:
            kept = [(p, t) for p, t, k in self.sm_target_choices.values() if k]
            report["sm_target"] = {"tuned": len(self.sm_target_choices), "kept": len(kept),
                                   "kept_speedup_median": round(float(np.median([p / t for p, t in kept])), 3)
                                   if kept else None}
        return report

    def run(self, partition_key: Any, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata, block_tables: list[list[int]],
            between: BetweenPieces | None = None, move_pending: MovePending | None = None) -> torch.Tensor | None:
        """Hidden states [num_seqs, hidden] of a pure-decode batch through a graph; None when too large. With
        pieces and `between`, the pieces launch just in time (`_run_pieces`, its waits cut short by
        `move_pending`); without, all at once."""
        n = len(block_tables)
        b = self.bucket(n) if n >= 1 else None
        if b is None:
            return None
        started = time.perf_counter()
        self._wait_s = 0.0
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:n].copy_(metadata.slot_mapping, non_blocking=True)
        if b > n:  # padding rows repeat row 0's token and position; their K/V go to the scratch slot (or row 0's)
            self.input_ids[n:b].copy_(self.input_ids[:1].expand(b - n))
            self.positions[n:b].copy_(self.positions[:1].expand(b - n))
            if self.scratch_slot is None:
                self.slots[n:b].copy_(self.slots[:1].expand(b - n))
            else:
                self.slots[n:b].fill_(self.scratch_slot)
        planned = time.perf_counter()
        plan = self._plan(b, block_tables, metadata.seq_lens_list)
        step = self._graph(partition_key, b, plan)
        # the host's time before the first replay (the step log's graph_setup_ms), the attention plan's part of it
        # (graph_plan_ms: page tables staged, flashinfer's plan where it can change, its fence's wait for the last one)
        # and the part of that the host waited for the GPU (graph_wait_ms: the staging slot's and the fence's waits)
        now = time.perf_counter()
        self.last_setup_s, self.last_plan_s, self.last_wait_s = now - started, now - planned, self._wait_s
        if between is None or self.pieces == 1:
            step.replay()
        else:
            step = self._run_pieces(partition_key, b, plan, step, between, move_pending)
        return step.out[:n]

    def _graph(self, partition_key: Any, b: int, plan: Any) -> StepGraph:
        key = (partition_key, b, plan)
        if key not in self.graphs:
            self.graphs[key] = self._capture_as_chosen(partition_key, b)
            self.num_captures += 1
            if self.is_serving:
                self.num_captures_serving += 1
                logger.warning("captured decode graph while serving (partition %s, bucket %d, plan %s)",
                               partition_key, b, plan)
        return self.graphs[key]

    def _run_pieces(self, partition_key: Any, b: int, plan: Any, step: StepGraph,
                    between: BetweenPieces, move_pending: MovePending | None = None) -> StepGraph:
        """Launch a step's pieces just in time: before piece i (i >= 2) the host waits for piece i - 2 to finish (one
        piece stays queued on the GPU), then `between` names the partition the rest runs on; on a move, the rest
        of the step (pieces, then sampling and the done event on the new stream) is ordered after the pieces so
        far. With `move_pending` the wait is polled and cut short once a split is requested, so the move follows
        the request within a poll rather than a piece (one more piece queued, on the old SMs; a hook that did not
        move then leaves the step's later waits whole; the last boundary's wait is always whole). Returns the
        graph set the last piece came from (its `out` holds the step's hidden states)."""
        ends: list[Any] = []
        moved = False
        may_cut = move_pending is not None
        self.last_move_piece, self.last_poll_gap_s = None, 0.0
        for i in range(len(step.pieces)):
            graph = step.pieces[i]
            if i > 0:
                cut = False
                if i >= 2:
                    # not at the last boundary: the entry published for the step moves one boundary after a move,
                    # and after the last there is none where the old pieces are seen to finish
                    if may_cut and i < len(step.pieces) - 1:
                        cut, gap = _wait_unless(ends[i - 2], move_pending)  # type: ignore[arg-type]
                        self.last_poll_gap_s = max(self.last_poll_gap_s, gap)
                    else:
                        ends[i - 2].synchronize()
                key, stream = between()
                if cut:
                    self.num_piece_waits_cut += 1
                    may_cut = key != partition_key  # not followed (a request this side cannot take): wait in full
                if key != partition_key:
                    current = torch.cuda.current_stream()
                    if stream is not None and stream != current:  # the rest of the step in order after the pieces
                        stream.wait_stream(current)  # so far, on the stream the worker's next step follows
                        torch.cuda.set_stream(stream)
                    moved_to = self.graphs.get((key, b, plan))  # captured at start for every partition
                    if moved_to is None:  # never captured (not expected): no capture inside a step; the rest of it
                        self.num_piece_moves_missing += 1  # replays the graphs it began with, on their SMs
                    else:
                        if not moved:
                            self.last_move_piece = i
                        partition_key, moved, step = key, True, moved_to
                        graph = step.pieces[i]
            graph.replay()
            end = torch.cuda.Event()
            end.record()
            ends.append(end)
        self.num_piece_moves += moved
        return step
