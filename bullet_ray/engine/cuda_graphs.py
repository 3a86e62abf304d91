"""CUDA graphs for pure-decode batches, captured lazily and keyed by what their kernels bake in.

A decode step is hundreds of small kernels; replaying a captured graph removes their launch cost.
flashinfer's decode wrapper runs in CUDA-graph mode with fixed index buffers that `plan` refills before
each replay. A graph bakes in:
- the SM partition of the stream it was captured on (each ladder entry needs its own graphs);
- the batch size (no padding);
- flashinfer's plan shape (split-KV or not, padded batch): a graph captured under one plan gave hidden
  states 12-18% off the eager ones when replayed under another (H100, benchmarks/results/
  gpu_graph_check_*.json), so the plan's own description is part of the key.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256


class DecodeGraphs:
    def __init__(self, model: Any, backend: Any, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.model, self.backend = model, backend
        self.block_size = block_size
        self.max_batch = min(max(1, max_num_seqs), MAX_GRAPH_BATCH)
        n, dev = self.max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.indptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.last_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.wrappers: dict[int, Any] = {}
        self.graphs: dict[tuple[Any, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def _wrapper(self, b: int) -> Any:
        if b not in self.wrappers:
            self.wrappers[b] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.backend.workspace, kv_layout="NHD", use_cuda_graph=True, use_tensor_cores=False,
                paged_kv_indptr_buffer=self.indptr[:b + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_len[:b])
        return self.wrappers[b]

    def _plan(self, b: int, tables: list[list[int]], seq_lens: list[int]) -> tuple[int, ...]:
        """Plan the wrapper of batch size b; returns the plan's description (part of the graph key)."""
        indptr, indices, last = [0], [], []
        for blocks, n in zip(tables, seq_lens):
            indices.extend(blocks)
            indptr.append(len(indices))
            last.append((n - 1) % self.block_size + 1)
        be, wrapper = self.backend, self._wrapper(b)
        wrapper.plan(torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32),
                     torch.tensor(last, dtype=torch.int32), be.num_heads, be.num_kv_heads, be.head_dim,
                     self.block_size, q_data_type=be.kv_cache.dtype, kv_data_type=be.kv_cache.dtype, sm_scale=be.scale)
        info = getattr(wrapper, "_plan_info", None)
        return tuple(int(x) for x in info) if info is not None else ()

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the forward of the current (already planned) batch of size b."""
        md = AttentionMetadata(query_start_loc=self.indptr[:b + 1], seq_lens=self.last_len[:b],
                               block_tables=self.indices[:b].view(b, 1), slot_mapping=self.slots[:b],
                               query_lens_list=[1] * b, seq_lens_list=[1] * b, block_size=self.block_size,
                               is_decode=True)
        saved = self.backend.decode
        self.backend.decode = self._wrapper(b)
        self.backend._is_decode = True
        try:
            stream = torch.cuda.current_stream()
            if stream == torch.cuda.default_stream():  # capture needs a side stream (no partition: whole GPU)
                stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            ctx = AttentionContext(self.backend, md)
            with torch.cuda.stream(stream):  # warm-ups rewrite the same K/V into the same slots: harmless
                for _ in range(2):
                    self.model.forward(self.input_ids[:b], self.positions[:b], ctx)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.model.forward(self.input_ids[:b], self.positions[:b], ctx)
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            self.backend.decode = saved
        return graph, out

    def run(self, key: Any, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            block_tables: list[list[int]]) -> torch.Tensor | None:
        """Hidden states of a pure-decode batch through a graph; None when the batch is too large."""
        b = len(block_tables)
        if not 1 <= b <= self.max_batch:
            return None
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(metadata.slot_mapping)
        plan = self._plan(b, block_tables, metadata.seq_lens_list)
        graph_key = (key, b, plan)
        if graph_key not in self.graphs:
            self.graphs[graph_key] = self._capture(b)
            logger.info("captured decode graph %d for partition %s, batch %d", len(self.graphs), key, b)
        graph, out = self.graphs[graph_key]
        graph.replay()
        return out
