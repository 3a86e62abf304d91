"""Piecewise CUDA graphs for steps with prompt tokens: everything but attention, by token-count bucket.

A prefill or mixed step of a few hundred tokens is hundreds of small launches (norms, projections,
rotary, MLP); in serving on the H100 the host took ~21 ms (34 below 64 tokens) to launch such a step
eagerly while the GPU needed about 10 (`benchmarks/results/serve_h100_m2e/launch.png`; 9-12 ms through
these graphs). Attention cannot be captured once for all steps (its plan depends on every request's lengths), the rest can: the forward is
cut at each layer's attention into num_layers + 1 pieces,

    piece 0:         embed, layer 0's input norm, q/k/v projection and rotary
    piece i (1..L-1): layer i-1's o_proj, post-attention norm and MLP; layer i's input norm, q/k/v, rotary
    piece L:         the last layer's o_proj, norm and MLP; the final norm

and each piece is one graph per bucket of tokens (`token_buckets`), replayed between eager attention calls
(the step's flashinfer plan, made once per step, serves every layer). What crosses a cut lives in static
buffers: input ids and positions, the fused q/k/v rows, the attention output and the residual stream;
a piece's own temporaries come from one memory pool shared by every piece and bucket (they replay one at
a time, in order). A step of n tokens runs on the bucket's first n rows; the rows past n hold the last
step's values (finite), flow through the row-wise pieces and are never read back. Attention sees the n
real rows only, so padding writes no K/V. The attention kernels read q straight from the fused q/k/v rows
(strided) and write into the attention-output buffer: between two graphs the host launches only the K/V
write and the attention kernels.

Which buckets above `TUNE_FROM` tokens (`tune_buckets`, `piecewise_buckets: tuned`, the default): cuBLAS picks its
GEMM tiles by shape, so a step's time does not grow smoothly with its rows. On the H100 (Llama-3.1-8B's
projections, benchmarks/results/gemm_shapes_h100/) 1,728 rows took 7% longer than 1,792 and 2,112 rows 13% longer
than 2,048. Before capturing, the worker times one middle piece (a layer's o_proj and MLP and the next layer's
q/k/v: every GEMM shape of the forward) at every multiple of its range's step (32 tokens to 4,096, then 64, then 128
to 16,384) in each tuned range the budget reaches and keeps at most as
many buckets as the fixed ladder (fewer where fewer are as fast), chosen to make a step of uniformly spread size
fastest on average (`choose_buckets`); at most the same graphs, memory and capture time, less time per step (on the H100's table: 2.6% off
the GEMMs of steps of 1,025-2,048 tokens against the every-128 buckets, 0.8% under running each step at its exact
size). `piecewise_buckets: fixed` keeps `token_buckets`.

Graphs keep the SM partition of the stream they were captured on (as decode graphs do), so each partition
gets its own set. Without capture (`capture=False`, the CPU) the same pieces run eagerly on the same
buffers: the tests check the cut against the whole forward there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.engine.cuda_graphs import CaptureStream
from bullet_ray.models.llama import store_into

logger = logging.getLogger(__name__)

# buckets double up to _DOUBLE_TOP tokens (launch- and bandwidth-bound there: padding costs little), then
# grow by a step that widens with the count: (up to, step) pairs, the last step for every count beyond.
# Above ~128 tokens the GEMMs near their compute bound, so padding costs what it adds: with steps of 256
# a 311-token decode ran as 512 rows (offline on the H100, benchmarks/results/lease_m2j); now as 320. The
# price is start-up: 33 buckets up to 2,048 tokens instead of 13, captured on every partition a side may run
# on; on the H100 serve_h100's ready time went from 37 / 76 s (chunked / bullet, serve_h100_m2i) to 47-57 /
# 116-118 s (serve_h100_m2j, m2k). Above 2,048 tokens (budgets larger than serving's: chunked-8192, vLLM's serving
# budget, and offline runs) every 128 to 4,096 and every 256 to 8,192 (each pads by under 6.3%): with every 256 / 512
# there, steps of 3.3-4.7k tokens ran their GEMMs 9-12% slower than vLLM's at their exact size, the padding
# (benchmarks/results/kernel_compare_h200/, 8,192-token budget); at 16 more buckets' capture (on the H200 at
# that budget 5.8 s of capture against 3.8 s, start-up 16.8 s against 13.7: kc8192_ours_finer_buckets/).
_DOUBLE_TOP = 128
_STEPS = ((512, 32), (1024, 64), (2048, 128), (4096, 128), (8192, 256), (None, 512))


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens: 8, 16, ..., 128, then every 32 up to 512, every 64 up to 1024,
    every 128 up to 4096, every 256 up to 8192 and every 512 beyond (the last one is max_tokens): past 128 tokens
    a step pads by under 25%, past 512 by under 13%, past 2,048 by under 6.3%. Serving limits stop at 2,048; the
    steps beyond serve larger budgets (chunked-8192, offline runs with vLLM's 16,384-token budget)."""
    if max_tokens < 1:
        return []
    buckets: list[int] = []
    b = 8
    while b < min(max_tokens, _DOUBLE_TOP):
        buckets.append(b)
        b *= 2
    b = _DOUBLE_TOP
    for top, step in _STEPS:
        while b < max_tokens and (top is None or b < top):
            buckets.append(b)
            b += step
    buckets.append(max_tokens)
    return buckets


# the ranges `tune_buckets` re-chooses: (low, high, candidates every `step` tokens) of the fixed ladder, each timed
# only when the budget reaches into it (a 2,048-token budget times the first two). Above 4,096 the candidates are
# coarser (64 / 128 tokens: the sizes to time stay 64 a range, ~1.7 s and ~3.4 s at start on the H200's 8B pieces):
# there the GEMMs of a padded bucket cost vLLM's exact-size steps +7% where the padding explains 3-4%
# (benchmarks/results/kernel_compare_h200/, kc8192_m16), cuBLAS's tiles being what the rest is.
TUNE_FROM, TUNE_UP_TO, TUNE_STEP = 512, 16384, 32
TUNE_RANGES = ((TUNE_FROM, 1024, TUNE_STEP), (1024, 2048, TUNE_STEP), (2048, 4096, TUNE_STEP), (4096, 8192, 64),
               (8192, TUNE_UP_TO, 128))
TUNE_HOLD_CYCLES = 20_000_000  # ~10 ms of a GPU clock: longer than the host takes to enqueue a size's timed runs


def choose_buckets(low: int, high: int, count: int, time_ms: dict[int, float]) -> list[int]:
    """At most `count` buckets in (low, high], the last one `high`, from the sizes `time_ms` times (in (low, high]),
    that make a step fastest on average when its token count is uniform over (low, high] and it runs on the
    smallest bucket holding it (`time_ms[t]`: the step's time on t rows). Dynamic programming over the sorted
    sizes: best[k][j] = the least total time of covering (low, size j] with k buckets, the last at size j."""
    sizes = sorted(t for t in time_ms if low < t <= high)
    if not sizes or sizes[-1] != high:
        raise ValueError(f"choose_buckets: no time for the range's top {high}")
    count = max(1, min(count, len(sizes)))
    inf = float("inf")
    best = [[inf] * len(sizes) for _ in range(count + 1)]
    came: list[list[int]] = [[-1] * len(sizes) for _ in range(count + 1)]
    for j, t in enumerate(sizes):
        best[1][j] = (t - low) * time_ms[t]
    for k in range(2, count + 1):
        for j, t in enumerate(sizes):
            for i in range(j):
                cost = best[k - 1][i] + (t - sizes[i]) * time_ms[t]
                if cost < best[k][j]:
                    best[k][j], came[k][j] = cost, i
    k = min(range(1, count + 1), key=lambda c: best[c][-1])  # fewer buckets may already be as fast
    chosen, j = [], len(sizes) - 1
    while k >= 1 and j >= 0:
        chosen.append(sizes[j])
        j, k = came[k][j], k - 1
    return sorted(chosen)


def tune_buckets(buckets: list[int], time_ms: Callable[[int], float]) -> tuple[list[int], dict[int, float]]:
    """`buckets` (token_buckets') with each of TUNE_RANGES that they span re-chosen by `choose_buckets` from
    measured times (`time_ms(t)`: a step's time on t rows, called once per size: every multiple of the range's step
    in the range and the range's top bucket), at most as many buckets per range as before. Returns the buckets and
    the times."""
    out, times = list(buckets), {}
    for low, high, step in TUNE_RANGES:
        inside = [b for b in out if low < b <= high]
        if not inside:
            continue
        top = inside[-1]  # the range's top, or the largest bucket when it ends inside the range
        sizes = sorted(set(range(low + step, top, step)) | {top})
        for t in sizes:
            if t not in times:
                times[t] = time_ms(t)
        chosen = choose_buckets(low, top, len(inside), {t: times[t] for t in sizes})
        out = [b for b in out if not low < b <= top] + chosen
        out.sort()
    return out, times


class PiecewiseGraphs:
    def __init__(self, model: Any, max_tokens: int, device: torch.device | str, capture: bool = True) -> None:
        self.model = model
        self.buckets = token_buckets(max_tokens)
        self.tuning: dict[str, Any] | None = None  # what `tune` measured and chose
        self.max_tokens = self.buckets[-1] if self.buckets else 0
        c = model.config
        self.num_layers = model.num_layers
        self.q_size, self.kv_size = c.q_size, c.kv_size
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t, dev, dtype = self.max_tokens, torch.device(device), model.output_weight().dtype
        self.input_ids = torch.zeros(t, dtype=torch.long, device=dev)
        self.positions = torch.zeros(t, dtype=torch.long, device=dev)
        self.qkv = torch.zeros(t, self.q_size + 2 * self.kv_size, dtype=dtype, device=dev)
        self.attn = torch.zeros(t, self.q_size, dtype=dtype, device=dev)
        self.residual = torch.zeros(t, c.hidden_size, dtype=dtype, device=dev)
        self.hidden = torch.zeros(t, c.hidden_size, dtype=dtype, device=dev)
        self.capture = capture
        # (partition key, bucket) -> one graph per piece
        self.graphs: dict[tuple[Any, int], list[Any]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._capture_stream = CaptureStream()
        self.num_captures = 0
        self.num_captures_serving = 0  # captures after is_serving was set (should stay 0)
        self.is_serving = False
        self.partition_keys: set[Any] = set()  # partitions captured (capture_all)
        self.capture_s = 0.0
        self.capture_bytes = 0
        # the last step's host time (s) launching its pieces (replay) and its eager attention (attention)
        self.last_host_s: dict[str, float] = {}

    def covers(self, partition_key: Any) -> bool:
        """Whether a step on this partition runs through the graphs: once serving, only partitions captured
        at start do (a decode side captures only its whole-GPU entry; elsewhere its steps run eagerly)."""
        return not self.is_serving or not self.capture or partition_key in self.partition_keys

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds num_tokens; None when the step is too large for graphs."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    # the pieces ---------------------------------------------------------------------------------------
    def _piece(self, i: int, t: int) -> None:
        """Piece i on the first t rows of the static buffers (see the module docstring)."""
        m, layers = self.model, self.model.model.layers
        pos, residual = self.positions[:t], self.residual[:t]
        if i == 0:
            h, res = m.embed(self.input_ids[:t]), None
        else:
            h, res = layers[i - 1].attention_outputs(self.attn[:t], residual)
            if i == self.num_layers:
                store_into(self.hidden[:t], m.final_norm(h, res))
                return
        _, _, _, res = layers[i].attention_inputs(pos, h, res, m.rotary, out=self.qkv[:t])
        store_into(residual, res)

    def _qkv(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.qkv[:n].split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(n, self.heads, self.head_dim), k.view(n, self.kv_heads, self.head_dim),
                v.view(n, self.kv_heads, self.head_dim))

    # bucket choice ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def tune(self, stream: Any = None, warmup: int = 2, reps: int = 5) -> None:
        """Re-choose the buckets above TUNE_FROM tokens from the device's own times (`tune_buckets`), before
        any capture: piece 1 (every GEMM shape of the forward) run eagerly on the static buffers, CUDA events
        around `reps` runs after `warmup`, on `stream` (the one partition the graphs are captured on). The
        activations are random (GEMMs of zeros draw less power and can run faster than a real step's), and a
        sleep kernel queued first holds the GPU while the host enqueues every run: the events time the GPU, not
        the host's launches (which a small model's pieces would otherwise be bound by, for every size alike)."""
        if not self.capture or self.graphs or self.num_layers < 2:
            return
        started = time.perf_counter()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            generator = torch.Generator(device=self.attn.device).manual_seed(0)
            self.attn.copy_(torch.randn(self.attn.shape, generator=generator, device=self.attn.device))
            self.residual.copy_(torch.randn(self.residual.shape, generator=generator, device=self.residual.device))

        def time_ms(t: int) -> float:
            with ctx:
                for _ in range(warmup):
                    self._piece(1, t)
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(TUNE_HOLD_CYCLES)  # the host enqueues the runs meanwhile
                begin.record()
                for _ in range(reps):
                    self._piece(1, t)
                end.record()
            end.synchronize()
            return begin.elapsed_time(end) / reps

        before = list(self.buckets)
        self.buckets, times = tune_buckets(before, time_ms)
        self.tuning = {"fixed": before, "tuned": list(self.buckets), "tune_s": round(time.perf_counter() - started, 3),
                       "piece_ms": {t: round(v, 4) for t, v in sorted(times.items())}}

    # capture ------------------------------------------------------------------------------------------
    def _capture_bucket(self, t: int, stream: Any) -> list[Any]:
        graphs = []
        for i in range(self.num_layers + 1):
            with torch.cuda.stream(stream):
                self._piece(i, t)  # warm-up (cuBLAS handles, kernel choice) outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self._piece(i, t)
            graphs.append(graph)
        return graphs

    @torch.inference_mode()
    def capture_all(self, partition_key: Any, stream: Any = None) -> None:
        """Capture every piece of every bucket for one partition (on its stream), largest bucket first (the
        pool's blocks then fit every smaller one)."""
        if not self.capture:
            return
        self.partition_keys.add(partition_key)
        start, before = time.perf_counter(), torch.cuda.memory_allocated()
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            for t in reversed(self.buckets):
                self._graphs_for(partition_key, t)
        torch.cuda.synchronize()
        self.capture_s += time.perf_counter() - start
        self.capture_bytes += torch.cuda.memory_allocated() - before

    def _graphs_for(self, partition_key: Any, t: int) -> list[Any]:
        """The pieces of bucket t on this partition, captured now (on the current stream's partition) if
        they were not at start."""
        graphs = self.graphs.get((partition_key, t))
        if graphs is not None:
            return graphs
        side = self._capture_stream.get()
        graphs = self.graphs[(partition_key, t)] = self._capture_bucket(t, side)
        torch.cuda.current_stream().wait_stream(side)
        self.num_captures += 1
        if self.is_serving:
            self.num_captures_serving += 1
            logger.warning("captured piecewise graphs while serving (partition %s, bucket %d)", partition_key, t)
        return graphs

    def capture_report(self) -> dict[str, Any]:
        report = {"num_graphs": sum(len(g) for g in self.graphs.values()), "buckets": list(self.buckets),
                  "capture_s": round(self.capture_s, 3), "capture_mb": round(self.capture_bytes / 2**20, 1),
                  "num_captures_serving": self.num_captures_serving}
        if self.tuning is not None:
            report["tuning"] = self.tuning
        return report

    # a step -------------------------------------------------------------------------------------------
    def run(self, partition_key: Any, input_ids: torch.Tensor, positions: torch.Tensor,
            ctx: AttentionContext) -> torch.Tensor | None:
        """Hidden states [num_tokens, hidden] of a step whose attention is planned (`begin_batch`); None
        when the step has more tokens than the largest bucket (it runs eagerly)."""
        n = int(input_ids.shape[0])
        t = self.bucket(n) if n >= 1 else None
        if t is None:
            return None
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        graphs = self._graphs_for(partition_key, t) if self.capture else None
        backend, md = ctx.backend, ctx.metadata
        q, k, v = self._qkv(n)  # views of the static buffers: the same for every layer
        attn = self.attn[:n].view(n, self.heads, self.head_dim)
        replay_s = attention_s = 0.0
        clock = time.perf_counter
        for i in range(self.num_layers + 1):
            started = clock()
            if graphs is not None:
                graphs[i].replay()
            else:
                self._piece(i, t)
            replayed = clock()
            replay_s += replayed - started
            if i < self.num_layers:
                out = backend.forward(i, q, k, v, md, out=attn)  # the kernels write the next piece's input
                store_into(attn, out)
                attention_s += clock() - replayed
        self.last_host_s = {"replay": replay_s, "attention": attention_s}
        return self.hidden[:n]
