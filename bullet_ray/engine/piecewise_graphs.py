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

Graphs keep the SM partition of the stream they were captured on (as decode graphs do), so each partition
gets its own set. Without capture (`capture=False`, the CPU) the same pieces run eagerly on the same
buffers: the tests check the cut against the whole forward there.
"""

from __future__ import annotations

import contextlib
import logging
import time
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
# 116-118 s (serve_h100_m2j, m2k).
_DOUBLE_TOP = 128
_STEPS = ((512, 32), (1024, 64), (2048, 128), (4096, 256), (None, 512))


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets up to max_tokens: 8, 16, ..., 128, then every 32 up to 512, every 64 up to 1024,
    every 128 up to 2048, every 256 up to 4096 and every 512 beyond (the last one is max_tokens): past 128 tokens
    a step pads by under 25%, past 512 by under 13%. Serving limits stop at 2,048; the coarser steps beyond serve
    offline runs with vLLM's 16,384-token budget (`benchmarks.offline --piecewise-graph-tokens`)."""
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


class PiecewiseGraphs:
    def __init__(self, model: Any, max_tokens: int, device: torch.device | str, capture: bool = True) -> None:
        self.model = model
        self.buckets = token_buckets(max_tokens)
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
        return {"num_graphs": sum(len(g) for g in self.graphs.values()), "buckets": list(self.buckets),
                "capture_s": round(self.capture_s, 3), "capture_mb": round(self.capture_bytes / 2**20, 1),
                "num_captures_serving": self.num_captures_serving}

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
