"""Runs one batch through the model over the paged KV pool and samples the next tokens.

The same runner serves every schedule: a batch is a list of (sequence, number of new tokens), so a
prefill batch, a decode batch and a chunked hybrid batch differ only in their numbers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionBackend, AttentionContext, AttentionMetadata
from bullet_ray.engine.outputs import TokenLogprob
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.transfer import to_device

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one executed batch produced."""

    # sequences that sampled a token this step, with the token appended to their output
    sampled: list[Sequence]
    logprobs: dict[str, TokenLogprob | None]
    num_tokens: int
    num_context_tokens: int


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
        self.graph_key: Any = 0

    def build_metadata(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat input ids, positions and the attention metadata of a batch (copied to the device without
        waiting for the GPU)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        bs = self.block_size
        for item in batch:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids_slice(start, end))
            positions.extend(range(start, end))
            blocks = seq.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(item.num_new_tokens)
            seq_lens.append(end)
        max_blocks = max(len(item.seq.block_ids) for item in batch)
        table = [item.seq.block_ids + [0] * (max_blocks - len(item.seq.block_ids)) for item in batch]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        metadata = AttentionMetadata(
            query_start_loc=to_device(qsl, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(table, torch.int32, dev),
            slot_mapping=to_device(slots, torch.int64, dev),
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
            block_size=bs,
            is_decode=all(n == 1 for n in query_lens),
        )
        ids = to_device(input_ids, torch.long, dev)
        pos = to_device(positions, torch.long, dev)
        return ids, pos, metadata

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq]) -> StepResult:
        """Run the batch, advance each sequence's computed count, sample for those that completed."""
        ids, pos, metadata = self.build_metadata(batch)
        hidden = None
        if self.graphs is not None and metadata.is_decode:
            bs = self.block_size
            tables = [item.seq.block_ids[:(n + bs - 1) // bs] for item, n in zip(batch, metadata.seq_lens_list)]
            hidden = self.graphs.run(self.graph_key, ids, pos, metadata, tables)
        if hidden is None:
            self.backend.begin_batch(metadata)
            hidden = self.model.forward(ids, pos, AttentionContext(self.backend, metadata))
        last_rows = [metadata.query_lens_list[0] - 1]
        for n in metadata.query_lens_list[1:]:
            last_rows.append(last_rows[-1] + n)
        sample_idx = [i for i, item in enumerate(batch) if item.completes_known_tokens]
        for item in batch:
            item.seq.num_computed_tokens += item.num_new_tokens
        sampled: list[Sequence] = []
        logprobs: dict[str, TokenLogprob | None] = {}
        if sample_idx:
            rows = to_device([last_rows[i] for i in sample_idx], torch.long, hidden.device)
            logits = self.model.compute_logits(hidden.index_select(0, rows)).float()
            seqs = [batch[i].seq for i in sample_idx]
            out = self.sampler.sample(logits, [s.sampling for s in seqs])
            for seq, token, lp in zip(seqs, out.token_ids, out.logprobs):
                seq.sampling.append(token)
                sampled.append(seq)
                logprobs[seq.request_id] = lp
        return StepResult(sampled, logprobs, len(ids), sum(metadata.seq_lens_list))
