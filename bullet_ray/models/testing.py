"""Single-process helpers for model tests: run a model over a small paged KV pool with the torch backend.

`greedy_generate` prefills every prompt in ONE ragged batch, then decodes one token per sequence per step,
all sequences together, exactly as the engine's runner does (but without its scheduler, shared memory or
workers). Blocks are handed out from a shuffled free list so a sequence's KV is never contiguous in the
pool, which exercises the block tables. This is a test oracle for the model code, not the engine.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import nn

from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata
from bullet_ray.engine.attention.torch_ref import TorchAttentionBackend
from bullet_ray.models.config import ModelConfig


class PagedRunner:
    """Owns a KV pool and each sequence's block table; builds AttentionMetadata for ragged batches."""

    def __init__(self, model: nn.Module, num_seqs: int, max_len_tokens: int, block_size: int = 4,
                 seed: int = 0) -> None:
        config: ModelConfig = model.config  # type: ignore[assignment]
        param = next(model.parameters())
        self.model = model
        self.block_size = block_size
        blocks_per_seq = -(-max_len_tokens // block_size)
        num_blocks = num_seqs * blocks_per_seq + 1  # block 0 is left unused: padding in block tables
        self.kv_cache = torch.zeros(config.num_hidden_layers, num_blocks, 2, block_size,
                                    config.num_key_value_heads, config.head_dim, dtype=param.dtype,
                                    device=param.device)
        self.backend = TorchAttentionBackend(self.kv_cache, config.num_attention_heads,
                                             config.num_key_value_heads, config.head_dim, config.head_dim ** -0.5)
        self._free_blocks = list(range(1, num_blocks))
        random.Random(seed).shuffle(self._free_blocks)
        self.block_tables: list[list[int]] = [[] for _ in range(num_seqs)]
        self.seq_lens = [0] * num_seqs
        self.max_blocks_per_seq = blocks_per_seq

    def _slot(self, seq: int, pos: int) -> int:
        table = self.block_tables[seq]
        while len(table) <= pos // self.block_size:
            table.append(self._free_blocks.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    @torch.no_grad()
    def step(self, new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append `new_tokens[i]` to sequence i (empty = not in this batch); returns the float32 logits of
        every new token, [sum(len), vocab], in batch order."""
        device = self.kv_cache.device
        ids, positions, slots, q_lens, s_lens, tables = [], [], [], [], [], []
        for seq, tokens in enumerate(new_tokens):
            if not tokens:
                continue
            start = self.seq_lens[seq]
            for j, token in enumerate(tokens):
                ids.append(int(token))
                positions.append(start + j)
                slots.append(self._slot(seq, start + j))
            self.seq_lens[seq] = start + len(tokens)
            q_lens.append(len(tokens))
            s_lens.append(self.seq_lens[seq])
            tables.append(self.block_tables[seq] + [0] * (self.max_blocks_per_seq - len(self.block_tables[seq])))
        offsets = [0]
        for n in q_lens:
            offsets.append(offsets[-1] + n)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(offsets, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(s_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_list=q_lens, seq_lens_list=s_lens, block_size=self.block_size,
            is_decode=all(n == 1 for n in q_lens),
        )
        self.backend.begin_batch(metadata)
        ctx = AttentionContext(self.backend, metadata)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=device),
                            torch.tensor(positions, dtype=torch.long, device=device), ctx)
        return self.model.compute_logits(hidden)  # type: ignore[operator]


def prefill_logits(model: nn.Module, prompts: Sequence[Sequence[int]], block_size: int = 4) -> list[torch.Tensor]:
    """Logits of every prompt position ([len, vocab] float32 each) from one batched prefill."""
    runner = PagedRunner(model, len(prompts), max(len(p) for p in prompts), block_size)
    logits = runner.step(prompts)
    out, start = [], 0
    for p in prompts:
        out.append(logits[start:start + len(p)])
        start += len(p)
    return out


def greedy_generate(model: nn.Module, prompt_ids: Sequence[int] | Sequence[Sequence[int]], max_new_tokens: int,
                    block_size: int = 4) -> list[int] | list[list[int]]:
    """Greedy continuation (EOS ignored) of one prompt (a list of ids) or several (a list of lists).

    All prompts are prefilled in one batch, then decoded together one token per step over the paged pool.
    Returns the new token ids: a list for one prompt, a list of lists for several.
    """
    single = len(prompt_ids) > 0 and isinstance(prompt_ids[0], int)
    prompts: list[list[int]] = [list(prompt_ids)] if single else [list(p) for p in prompt_ids]  # type: ignore[arg-type]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_generate needs non-empty prompts")
    runner = PagedRunner(model, len(prompts), max(len(p) for p in prompts) + max_new_tokens, block_size)
    outputs: list[list[int]] = [[] for _ in prompts]
    if max_new_tokens > 0:
        logits = runner.step(prompts)
        ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        next_ids = logits[ends.to(logits.device)].argmax(-1).tolist()
        for _ in range(max_new_tokens - 1):
            for out, token in zip(outputs, next_ids):
                out.append(token)
            next_ids = runner.step([[t] for t in next_ids]).argmax(-1).tolist()
        for out, token in zip(outputs, next_ids):
            out.append(token)
    return outputs[0] if single else outputs
