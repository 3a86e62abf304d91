"""CUDA graphs for pure-decode batches: one graph per (SM partition, batch-size bucket), captured lazily.

A decode step is hundreds of small kernels; replaying a captured graph removes their launch cost. The
batch is padded to the next bucket; padding rows decode a dummy token into a scratch KV block the
worker reserved, so they never touch a real sequence. flashinfer's decode wrapper runs in CUDA-graph mode
with fixed index buffers that `plan` refills before each replay. Graphs keep the SM partition of the
stream they were captured on, so each ladder entry gets its own set (the key).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata

logger = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraphs:
    def __init__(self, model: Any, backend: Any, block_size: int, max_num_seqs: int, max_blocks_per_seq: int,
                 scratch_block: int, device: torch.device) -> None:
        import flashinfer

        self.model, self.backend = model, backend
        self.block_size = block_size
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        self.buckets = [b for b in BUCKETS if b <= max(1, max_num_seqs)]
        if max_num_seqs > self.buckets[-1] and max_num_seqs <= BUCKETS[-1]:
            self.buckets.append(next(b for b in BUCKETS if b >= max_num_seqs))
        self.max_batch = self.buckets[-1]
        n, dev = self.max_batch, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.indptr = torch.zeros(n + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(n * max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.last_len = torch.ones(n, dtype=torch.int32, device=dev)
        self.wrappers = {
            b: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                backend.workspace, kv_layout="NHD", use_cuda_graph=True,
                use_tensor_cores=False,  # the CUDA-core decode kernel: its launch shape does not depend on the plan
                paged_kv_indptr_buffer=self.indptr[:b + 1], paged_kv_indices_buffer=self.indices,
                paged_kv_last_page_len_buffer=self.last_len[:b])
            for b in self.buckets}
        self.graphs: dict[tuple[Any, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _plan(self, b: int, seq_blocks: list[list[int]], seq_lens: list[int]) -> None:
        indptr, indices, last = [0], [], []
        for blocks, n in zip(seq_blocks, seq_lens):
            indices.extend(blocks)
            indptr.append(len(indices))
            last.append((n - 1) % self.block_size + 1)
        for _ in range(b - len(seq_lens)):  # padding rows: one token in the scratch block
            indices.append(self.scratch_block)
            indptr.append(len(indices))
            last.append(1)
        be = self.backend
        self.wrappers[b].plan(torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32),
                              torch.tensor(last, dtype=torch.int32), be.num_heads, be.num_kv_heads, be.head_dim,
                              self.block_size, q_data_type=be.kv_cache.dtype, kv_data_type=be.kv_cache.dtype,
                              sm_scale=be.scale)

    def _metadata(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(query_start_loc=self.indptr[:b + 1], seq_lens=self.last_len[:b],
                                 block_tables=self.indices[:b].view(b, 1), slot_mapping=self.slots[:b],
                                 query_lens_list=[1] * b, seq_lens_list=[1] * b, block_size=self.block_size,
                                 is_decode=True)

    def _capture(self, key: Any, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self._plan(b, [[self.scratch_block]] * 0, [])
        md = self._metadata(b)
        saved = self.backend.decode
        self.backend.decode = self.wrappers[b]
        self.backend._is_decode = True
        try:
            stream = torch.cuda.current_stream()
            if stream == torch.cuda.default_stream():  # capture needs a side stream (no partition: whole GPU)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up outside the graph (allocations, autotuning)
                    self.model.forward(self.input_ids[:b], self.positions[:b], AttentionContext(self.backend, md))
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = self.model.forward(self.input_ids[:b], self.positions[:b], AttentionContext(self.backend, md))
            torch.cuda.current_stream().wait_stream(stream)
        finally:
            self.backend.decode = saved
        logger.info("captured decode graph key=%s batch=%d", key, b)
        return graph, out

    def run(self, key: Any, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
            block_tables: list[list[int]]) -> torch.Tensor | None:
        """Hidden states of a pure-decode batch through a graph; None when the batch has no bucket."""
        n = len(block_tables)
        b = self.bucket(n)
        if b is None:
            return None
        if (key, b) not in self.graphs:
            self.graphs[(key, b)] = self._capture(key, b)
        graph, out = self.graphs[(key, b)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(metadata.slot_mapping)
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slots[n:b].fill_(self.scratch_slot)
        self._plan(b, block_tables, metadata.seq_lens_list)
        graph.replay()
        return out[:n]
