"""Runs one batch through the model over the paged KV pool and samples the next tokens.

The same runner serves every schedule: a batch is a list of (sequence, number of new tokens), so a
prefill batch, a decode batch and a chunked hybrid batch differ only in their numbers.

A step is launched (`launch`: inputs, forward, sampling, all queued on the device) and later collected
(`collect`: the host learns the sampled ids and appends them). Between the two the host may plan and
launch the next step: a sequence's token sampled by the last launched step is still on the device
(`Sequence.num_pending_tokens`), and the next step's input ids take it from there by a device-side
gather, so the GPU never waits for the host. `execute` is launch + collect at once (synchronous).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionBackend, AttentionContext, AttentionMetadata
from bullet_ray.engine.layerwise import BetweenGroups, forward_in_groups
from bullet_ray.engine.outputs import TokenLogprob
from bullet_ray.engine.scheduler.base import ScheduledSeq, is_decode_only
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.transfer import allocator_counts, to_device

logger = logging.getLogger(__name__)

SLOW_LAUNCH_S = 0.03  # a launch this long likely waited for the GPU inside (piecewise steps take ~9-15 ms)


@dataclass
class StepResult:
    """What one executed batch produced."""

    # sequences that sampled a token this step, with the token appended to their output
    sampled: list[Sequence]
    logprobs: dict[str, TokenLogprob | None]
    num_tokens: int
    num_context_tokens: int


@dataclass
class InFlightStep:
    """A launched step whose sampled ids the host has not read yet."""

    batch: list[ScheduledSeq]
    sampled: list[Sequence]  # sequences that sample this step (one pending token each)
    sample: Any  # bullet_ray.engine.sampler.DeviceSample, or None when nothing samples
    host_ids: torch.Tensor | None  # pinned copy of the sampled ids, valid once `done` has passed
    done: Any  # torch.cuda.Event recorded after the copy (None on CPU: already done)
    num_tokens: int
    num_context_tokens: int
    # a sequence of this step samples with penalties: the next step needs its ids on the host first
    needs_host_history: bool = False
    launched_s: float = 0.0  # perf_counter when launched (the worker's step-time bookkeeping)
    # perf_counter when its launch began: a launch in layer groups or decode pieces runs on the GPU while it launches
    began_s: float = 0.0
    perf_record: Any = None  # the bullet sides' (shape, predicted seconds, other side busy, ladder index)
    # a bullet side in overlap mode launched it before the other side followed a switch (SMs may be shared)
    launched_unsettled: bool = False
    # a bullet side launched it while the other side had a step in flight on another ladder entry
    beside_other_entry: bool = False
    launch_epoch: int = 0  # the split switch's request count when it was launched (bullet sides)
    # the side moved to another entry while launching it (between a layer-wise prefill's groups or a decode step's
    # pieces): it ran on two
    moved_while_launching: bool = False
    # decode pieces: the host's waits for a piece that a split requested meanwhile cut short (DecodeGraphs._run_pieces)
    piece_waits_cut: int = 0
    moved_at_piece: int | None = None  # decode pieces: the first boundary (piece index) where the step moved
    # decode pieces: the longest gap (s) between two looks at a requested split in the host's polled waits
    piece_poll_gap_s: float = 0.0
    num_layer_groups: int = 1  # layer groups the forward ran in (layer-wise prefill, decode pieces; 1: whole forward)
    start_event: Any = None  # torch.cuda.Event (timing) recorded before the step's first copy (None on CPU)
    gpu_time_s: float | None = None  # start_event -> done on the device, known once collected (None on CPU)
    # host time (s) on the way to the device, for the step log: planning the batch (the worker's plan), the
    # inputs and attention metadata (prep: build_metadata), the forward enqueued (forward, which includes the
    # attention plan: attn_plan, or a decode graph's, whose host time before its first replay is graph_setup, the
    # plan's part of that graph_plan and the host's waits for the GPU in it graph_wait; for piecewise graphs its
    # graph replays and eager
    # attention calls: replay, attention), logits and sampling enqueued (sample), the whole launch, and the
    # host's gap since it finished collecting the step before; `sample` is split into the sampled rows (their
    # indices, the sequences' counts and, unless every row of a one-token-a-row step samples, the rows' copy to
    # the device and their gather: sample_rows), the logits (logits), the
    # sampler's kernels (sampler) and the ids' copy back (to_host)
    host_s: dict[str, float] = field(default_factory=dict)
    graphs: str = "eager"  # how the forward ran: "decode" (one graph), "piecewise" (graphs around attention), "eager"
    # after a launch that held the host SLOW_LAUNCH_S or more (on GPU): the caching allocators' block counts so
    # far (transfer.allocator_counts, cumulative), so a step log shows whether an allocator grew since the last
    # slow launch (and synchronized); a layer-wise launch waits between its groups and always counts as slow
    allocator: dict[str, int] = field(default_factory=dict)
    # the ladder entry it holds SMs on last (set by the bullet sides: where its last kernels run, or after a decode
    # move no later boundary saw the old pieces finish behind, those pieces' entry: DecodeWorker._runs_on_now)
    runs_on: int | None = None

    def host_ms(self) -> dict[str, float]:
        """The host timings in ms, keyed for the step log (`plan_ms`, `prep_ms`, `look_ms`, `attn_plan_ms`,
        `graph_setup_ms`, `graph_plan_ms`, `graph_wait_ms`, `forward_ms`, `look_sample_ms`,
        `replay_ms`, `attention_ms`, `sample_ms` with its parts `sample_rows_ms`, `logits_ms`, `sampler_ms`,
        `to_host_ms`, then `launch_ms`, `gap_ms`, where the step had them)."""
        return {f"{k}_ms": round(v * 1e3, 4) for k, v in self.host_s.items()}

    def log_fields(self) -> dict[str, Any]:
        """What the step log records of the launch: `host_ms()`, after a slow launch the allocators' counts
        (`host_allocs`, `device_allocs`: cumulative), and for a step that moved to another entry while it launched
        (between layer groups or decode pieces) `moved_while_launching` and the entry it held SMs on last (`runs_on`),
        `piece_waits_cut` where a requested split cut the host's wait for a decode piece, `moved_at_piece`, the
        first boundary where a decode step in pieces moved, and `piece_poll_gap_ms`, the longest gap between the
        host's looks at a requested split while it waited for a piece; `launch_began_t`, the wall time its launch began
        (the record's `t` clock: where a split decision fell inside the launch, `plot_steps.slow_switches`)."""
        moved = {"moved_while_launching": True, "runs_on": self.runs_on} if self.moved_while_launching else {}
        cut = {"piece_waits_cut": self.piece_waits_cut} if self.piece_waits_cut else {}
        at = {"moved_at_piece": self.moved_at_piece} if self.moved_at_piece is not None else {}
        gap = {"piece_poll_gap_ms": round(self.piece_poll_gap_s * 1e3, 4)} if self.piece_poll_gap_s else {}
        began = {"launch_began_t": round(time.time() - (time.perf_counter() - self.began_s), 6)} if self.began_s else {}
        return {**self.host_ms(), **self.allocator, **moved, **cut, **at, **gap, **began}


def token_slots(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV pool slots (block * block_size + offset) of positions [start, end) of a sequence whose pages are `blocks`:
    one range per page touched, not one Python step per token (a 2,048-token chunk touches 128 pages of 16)."""
    out: list[int] = []
    pos = start
    while pos < end:
        page, offset = divmod(pos, block_size)
        take = min(block_size - offset, end - pos)
        base = blocks[page] * block_size + offset
        out.extend(range(base, base + take))
        pos += take
    return out


@dataclass
class ForwardPass:
    """A batch's forward as `ModelRunner.forward` enqueued it."""

    metadata: AttentionMetadata
    hidden: torch.Tensor  # the last layer's output rows (on the device; written once the forward has run)
    num_tokens: int
    host_s: dict[str, float]  # InFlightStep.host_s's prep, forward and the forward's parts
    ran: str = "eager"  # InFlightStep.graphs
    num_groups: int = 1  # layer groups or decode pieces it ran in
    waits_cut: int = 0  # decode pieces: InFlightStep.piece_waits_cut
    moved_at: int | None = None  # decode pieces: InFlightStep.moved_at_piece
    poll_gap: float = 0.0  # decode pieces: InFlightStep.piece_poll_gap_s


class ModelRunner:
    def __init__(self, model: Any, backend: AttentionBackend, sampler: Any, block_size: int,
                 device: torch.device | str) -> None:
        self.model = model
        self.backend = backend
        self.sampler = sampler
        self.block_size = block_size
        self.device = torch.device(device)
        # CUDA graphs for pure-decode batches (bullet_ray.engine.cuda_graphs.DecodeGraphs), keyed by the
        # SM partition the worker runs on; None = always eager
        self.graphs: Any = None
        # CUDA graphs around attention for steps with prompt tokens
        # (bullet_ray.engine.piecewise_graphs.PiecewiseGraphs), same keys; None = eager
        self.piecewise: Any = None
        self.graph_key: Any = 0
        # the last launched step's sampled ids on the device, and each sampling sequence's row in them
        self._last_ids: torch.Tensor | None = None
        self._last_rows: dict[str, int] = {}

    def build_metadata(self, batch: list[ScheduledSeq], page_table: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and the attention metadata of a batch (copied to the device without
        waiting for the GPU). A token still pending on the device is gathered from the last step's ids. Without
        `page_table` (a step a decode graph runs: it stages its own page indices, `DecodeGraphs._plan`) the padded
        block table is neither built nor copied, and `block_tables` is [num_seqs, 0]."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        gather_dst: list[int] = []
        gather_src: list[int] = []
        bs = self.block_size
        for item in batch:
            seq, num_new = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + num_new
            known = seq.num_known_tokens
            if end > known:  # the last token is the one the previous step sampled
                if end - known != 1 or seq.request_id not in self._last_rows:
                    raise RuntimeError(f"sequence {seq.request_id}: tokens [{known}, {end}) are not on the host "
                                       "and not from the last launched step")
                gather_dst.append(len(input_ids) + end - 1 - start)
                gather_src.append(self._last_rows[seq.request_id])
                if start < known:
                    input_ids.extend(seq.token_ids_slice(start, known))
                input_ids.append(0)
            else:
                input_ids.extend(seq.token_ids_slice(start, end))
            blocks = seq.block_ids
            if num_new == 1:  # a decode token: one position and one slot, without a range and a generator
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                positions.extend(range(start, end))
                slots.extend(token_slots(blocks, start, end, bs))
            query_lens.append(num_new)
            seq_lens.append(end)
        max_blocks = max(len(item.seq.block_ids) for item in batch) if page_table else 0
        table: list[int] = []  # [batch, max_blocks] row-major, padded with block 0
        if page_table:
            for item in batch:
                table.extend(item.seq.block_ids)
                table.extend([0] * (max_blocks - len(item.seq.block_ids)))
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        # two copies to the device, not seven: the int64 arrays travel as one, the int32 ones as another,
        # and each tensor is a view of its part (each copy costs the host a pinned buffer and a launch)
        t, b, g = len(input_ids), len(batch), len(gather_dst)
        longs = to_device(input_ids + positions + slots + gather_src + gather_dst, torch.long, self.device)
        ints = to_device(qsl + seq_lens + table, torch.int32, self.device)
        metadata = AttentionMetadata(
            query_start_loc=ints[:b + 1],
            seq_lens=ints[b + 1:2 * b + 1],
            block_tables=ints[2 * b + 1:].view(b, max_blocks),
            slot_mapping=longs[2 * t:3 * t],
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            block_size=bs,
            is_decode=all(n == 1 for n in query_lens),
        )
        ids = longs[:t]
        if g:
            assert self._last_ids is not None
            src = self._last_ids.index_select(0, longs[3 * t:3 * t + g])
            ids.index_copy_(0, longs[3 * t + g:], src)
        return ids, longs[t:2 * t], metadata

    def on_graph(self, batch: list[ScheduledSeq]) -> bool:
        """Whether a decode graph bucket holds `batch` (a pure-decode step): such a step never reads the metadata's
        page table (the graph stages its own page indices), so `build_metadata` may leave it out."""
        return self.graphs is not None and bool(batch) and is_decode_only(batch) \
            and self.graphs.bucket(len(batch)) is not None

    @torch.inference_mode()
    def launch(self, batch: list[ScheduledSeq], num_layer_groups: int = 1,
               between_groups: BetweenGroups | None = None,
               move_pending: Callable[[], bool] | None = None,
               before_forward: Callable[[], Any] | None = None,
               before_sample: Callable[[], Any] | None = None) -> InFlightStep:
        """Queue the batch's forward and sampling on the device; advance each sequence's computed count and
        count its sampled token as pending. Nothing here waits for the GPU, except with num_layer_groups > 1:
        the forward then runs in that many layer groups over one attention metadata, and between groups the
        host waits for the groups so far and calls `between_groups` (bullet_ray.engine.layerwise); a decode step
        through graphs captured in pieces launches them just in time instead, the host waiting for the piece
        before the last one launched, or until `move_pending` says a split was requested (DecodeGraphs.run;
        `graph_key` is read again after each call of the hook). `before_sample`, called once the forward is
        launched and before the sampling launch, and again once the logits are launched, may move the worker as
        `before_forward` may (its stream takes the rest of the sampling and the done event)."""
        start_event = None
        if self.device.type == "cuda":  # the step's device time (the host's clock also counts its own gaps)
            start_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
        began = time.perf_counter()
        fwd = self.forward(batch, num_layer_groups, between_groups, move_pending, before_forward)
        metadata, hidden, host_s = fwd.metadata, fwd.hidden, fwd.host_s
        if before_sample is not None:  # the forward is launched; the sampling launch may follow a requested split
            looked = time.perf_counter()
            self._go_on(before_sample())
            host_s["look_sample"] = time.perf_counter() - looked
        sample_started = time.perf_counter()
        # one pass over the batch (its host time grows with the rows: ~0.2 ms at 100 on the H200 host, m24): the rows
        # that sample (their step computes the last known token) and every row's computed count advanced
        sample_idx, seqs = [], []
        for i, item in enumerate(batch):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if seq.num_computed_tokens == seq.num_tokens:  # item.completes_known_tokens, read after the advance
                sample_idx.append(i)
                seqs.append(seq)
        sample = host_ids = done = None
        if sample_idx:
            # each part timed on its own: a call that blocks the host (a new pinned or device block where the
            # allocators must grow synchronizes with the GPU) shows where in the step log
            if metadata.is_decode and len(sample_idx) == len(batch):  # one token a row, every row samples: its
                rows_hidden = hidden  # hidden states are the rows to sample, no gather, no copy
            else:
                last_rows = list(itertools.accumulate(metadata.query_lens_list))  # one past each row's last token
                picked = [last_rows[i] - 1 for i in sample_idx]  # each sampling row's last token
                rows_hidden = hidden.index_select(0, to_device(picked, torch.long, hidden.device))
            logits_started = time.perf_counter()
            logits = self.model.compute_logits(rows_hidden, upcast=False)  # the sampler upcasts
            sampler_started = time.perf_counter()
            if before_sample is not None:  # a second look, the sampling launch being ~1 ms of host time at 100 rows
                stream = before_sample()
                self._go_on(stream)
                if stream is not None and logits.is_cuda:  # made on the old stream, read on this one: kept till then
                    logits.record_stream(torch.cuda.current_stream())
                looked = time.perf_counter()
                host_s["look_sample"] = host_s.get("look_sample", 0.0) + looked - sampler_started
                sampler_started = looked
            sample = self.sampler.sample_on_device(logits, [s.sampling for s in seqs])
            self._last_ids = sample.token_ids
            to_host_started = time.perf_counter()
            if sample.token_ids.device.type == "cuda":
                # the host reads these after the step's event: a blocking copy would wait for the next step too
                host_ids = torch.empty(len(seqs), dtype=torch.long, pin_memory=True)
                host_ids.copy_(sample.token_ids, non_blocking=True)
                sample = sample.logprobs_to_host()
            else:
                host_ids = sample.token_ids
            host_s.update(sample_rows=logits_started - sample_started, logits=sampler_started - logits_started,
                          sampler=to_host_started - sampler_started, to_host=time.perf_counter() - to_host_started)
        if self.device.type == "cuda":  # every step, sampling or not: the host learns when its blocks are free
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        self._last_rows = {s.request_id: i for i, s in enumerate(seqs)}
        for seq in seqs:
            seq.num_pending_tokens += 1
        needs_history = any(_uses_history(s) for s in seqs)
        launched = time.perf_counter()
        host_s["sample"] = launched - sample_started
        allocator = allocator_counts() if done is not None and launched - began >= SLOW_LAUNCH_S else {}
        return InFlightStep(batch, seqs, sample, host_ids, done, fwd.num_tokens, sum(metadata.seq_lens_list),
                            needs_host_history=needs_history, num_layer_groups=fwd.num_groups,
                            start_event=start_event, host_s=host_s, graphs=fwd.ran, allocator=allocator,
                            piece_waits_cut=fwd.waits_cut, moved_at_piece=fwd.moved_at, piece_poll_gap_s=fwd.poll_gap)

    def _go_on(self, stream: Any) -> None:
        """The rest of a launching step on `stream` (a hook's answer; None: where it is), ordered after what the
        current stream holds."""
        if stream is not None and self.device.type == "cuda":
            current = torch.cuda.current_stream()
            if stream != current:
                stream.wait_stream(current)
                torch.cuda.set_stream(stream)

    def forward(self, batch: list[ScheduledSeq], num_layer_groups: int = 1,
                between_groups: BetweenGroups | None = None,
                move_pending: Callable[[], bool] | None = None,
                before_forward: Callable[[], Any] | None = None) -> ForwardPass:
        """`launch`'s first half: the batch's inputs and attention metadata, and its forward enqueued (a decode
        graph, in pieces with `between_groups`; piecewise graphs; else eager, in `num_layer_groups` layer groups
        with `between_groups`), neither sampling nor touching the sequences' counts, so a batch may run it again
        (`bullet_ray.perf.sweep` times steps with it). `before_forward`, called once the inputs are prepared and
        before anything of the forward (a decode graph's set-up included), may move the worker to another
        partition: `graph_key` is read after it, and the stream it returns (None: stay) takes the rest, ordered
        after what the current one holds. Its host times: `prep`, `look` (before_forward's), `forward` and the
        graph set-up's parts, or the eager attention plan's."""
        prep_started = time.perf_counter()
        on_graph = self.on_graph(batch)
        ids, pos, metadata = self.build_metadata(batch, page_table=not on_graph)
        forward_started = time.perf_counter()
        host_s = {"prep": forward_started - prep_started}
        if before_forward is not None:
            self._go_on(before_forward())  # the inputs' copies, and what the last step left there, before the rest
            now = time.perf_counter()
            host_s["look"], forward_started = now - forward_started, now
        hidden = None
        num_groups = 1
        ran = "eager"
        waits_cut = 0
        moved_at = None
        poll_gap = 0.0
        if self.graphs is not None and metadata.is_decode:
            bs = self.block_size
            tables = [item.seq.block_ids[:(n + bs - 1) // bs] for item, n in zip(batch, metadata.seq_lens_list)]
            pieces_hook = None
            if num_layer_groups > 1 and between_groups is not None:  # the decode step in pieces, just in time
                def pieces_hook() -> tuple[Any, Any]:
                    stream = between_groups()  # the worker's hook may move it: graph_key follows
                    return self.graph_key, stream
            cut_before = self.graphs.num_piece_waits_cut
            hidden = self.graphs.run(self.graph_key, ids, pos, metadata, tables, between=pieces_hook,
                                     move_pending=move_pending)
            waits_cut = self.graphs.num_piece_waits_cut - cut_before
            if hidden is not None:
                ran = "decode"
                host_s.update(graph_setup=self.graphs.last_setup_s, graph_plan=self.graphs.last_plan_s,
                              graph_wait=self.graphs.last_wait_s)
                num_groups = self.graphs.pieces if pieces_hook is not None else 1
                if pieces_hook is not None:  # what `_run_pieces` kept of this step (a batch no bucket holds: none)
                    moved_at, poll_gap = self.graphs.last_move_piece, self.graphs.last_poll_gap_s
        if hidden is None:
            if on_graph:  # not expected (a bucket held the batch): the eager forward reads the page table
                ids, pos, metadata = self.build_metadata(batch)
            self.backend.begin_batch(metadata)  # once per batch: every layer group reuses the plan
            host_s["attn_plan"] = time.perf_counter() - forward_started
            ctx = AttentionContext(self.backend, metadata)
            if num_layer_groups > 1:
                num_groups = min(num_layer_groups, self.model.num_layers)
                hidden = forward_in_groups(self.model, ids, pos, ctx, num_groups, between_groups)
            else:
                if self.piecewise is not None and self.piecewise.covers(self.graph_key):
                    hidden = self.piecewise.run(self.graph_key, ids, pos, ctx)
                    if hidden is not None:
                        ran = "piecewise"
                        host_s.update(self.piecewise.last_host_s)
                if hidden is None:
                    hidden = self.model.forward(ids, pos, ctx)
        host_s["forward"] = time.perf_counter() - forward_started
        return ForwardPass(metadata, hidden, len(ids), host_s, ran, num_groups, waits_cut, moved_at, poll_gap)

    def collect(self, step: InFlightStep) -> StepResult:
        """Wait for a launched step, append each sampled id to its sequence. Sequences already finished
        or aborted (`finish_reason` set) drop their token; they are left out of `sampled`."""
        if step.done is not None:
            step.done.synchronize()
            if step.start_event is not None:
                step.gpu_time_s = step.start_event.elapsed_time(step.done) / 1e3
        sampled: list[Sequence] = []
        logprobs: dict[str, TokenLogprob | None] = {}
        if step.sample is not None:
            assert step.host_ids is not None
            out = step.sample.to_output(step.host_ids.tolist())
            for seq, token, lp in zip(step.sampled, out.token_ids, out.logprobs):
                seq.num_pending_tokens -= 1
                if seq.finish_reason is not None:
                    continue
                seq.sampling.append(token)
                sampled.append(seq)
                logprobs[seq.request_id] = lp
        return StepResult(sampled, logprobs, step.num_tokens, step.num_context_tokens)

    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """Run the batch, advance each sequence's computed count, sample for those that completed."""
        return self.collect(self.launch(batch))


def _uses_history(seq: Sequence) -> bool:
    """Whether sampling this sequence's next token reads its output ids on the host (penalties): then its
    pending token must be learned before the next step is planned."""
    return seq.params.has_penalties
