"""In-process engine pieces for GPU benchmarks: a model, a KV tensor, and greedy batches through ModelRunner."""

from __future__ import annotations

from typing import Any

import torch

from bullet_ray.engine.attention.base import get_backend_class
from bullet_ray.engine.runner import ModelRunner
from bullet_ray.engine.sampler import Sampler, SamplingState
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.sequence import Sequence


def make_runner(model: Any, cfg: Any, backend: str, num_blocks: int, block_size: int, device: str,
                dtype: torch.dtype) -> tuple[ModelRunner, torch.Tensor]:
    kv = torch.zeros(cfg.num_hidden_layers, num_blocks, 2, block_size, cfg.num_key_value_heads, cfg.head_dim,
                     dtype=dtype, device=device)
    be = get_backend_class(backend)(kv, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                    cfg.head_dim ** -0.5)
    return ModelRunner(model, be, Sampler(), block_size, device), kv


def make_seqs(prompts: list[list[int]], max_tokens: int, block_size: int, max_len: int) -> list[Sequence]:
    seqs, next_block = [], 0
    per_seq = (max_len + block_size - 1) // block_size
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(f"r{i}", list(ids), SamplingState(params, list(ids)), 0.0, max_len)
        seq.block_ids = list(range(next_block, next_block + per_seq))
        next_block += per_seq
        seqs.append(seq)
    return seqs


def greedy(runner: ModelRunner, prompts: list[list[int]], num_new: int, block_size: int,
           max_len: int) -> list[list[int]]:
    """One prefill batch of every prompt, then batched decode steps; returns generated ids per prompt."""
    seqs = make_seqs(prompts, num_new, block_size, max_len)
    runner.execute([ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs])
    for _ in range(num_new - 1):
        runner.execute([ScheduledSeq(s, 1) for s in seqs])
    return [list(s.output_token_ids) for s in seqs]


@torch.inference_mode()
def first_logits(runner: ModelRunner, prompts: list[list[int]], block_size: int, max_len: int) -> torch.Tensor:
    from bullet_ray.engine.attention.base import AttentionContext

    seqs = make_seqs(prompts, 1, block_size, max_len)
    batch = [ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]
    ids, pos, md = runner.build_metadata(batch)
    runner.backend.begin_batch(md)
    hidden = runner.model.forward(ids, pos, AttentionContext(runner.backend, md))
    last = torch.tensor(md.query_start_loc.tolist()[1:], device=hidden.device) - 1
    return runner.model.compute_logits(hidden[last]).float().cpu()


def forced_agreement(runner: ModelRunner, prompts: list[list[int]], ref: list[list[int]], block_size: int,
                     max_len: int) -> list[float]:
    """Decode step by step feeding the reference's tokens (teacher forcing): the share of steps whose greedy
    token equals the reference's. Unlike free-running agreement, one near-tie does not derail the rest."""
    num_new = len(ref[0])
    seqs = make_seqs(prompts, num_new, block_size, max_len)
    hits = [0] * len(seqs)
    for step in range(num_new):
        batch = [ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]
        runner.execute(batch)
        for i, s in enumerate(seqs):
            hits[i] += int(s.output_token_ids[-1] == ref[i][step])
            s.output_token_ids[-1] = ref[i][step]
    return [h / num_new for h in hits]
