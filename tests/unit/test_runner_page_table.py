"""A decode step a graph bucket holds is prepared without the padded page table (the graph stages its own).

`ModelRunner.launch` builds the metadata's block table only for steps the eager forward runs: on a pure-decode
batch that `DecodeGraphs.bucket` holds, the host neither builds nor copies it (half of `build_metadata`'s time at
113 sequences on CPU, `benchmarks/results/decode_prep_cpu/`). A stand-in for the graphs runs the eager forward
from a full metadata, so the tokens must equal a run without graphs.
"""

from __future__ import annotations

from typing import Any

import torch

from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.engine.scheduler.base import ScheduledSeq

PROMPTS = [[5, 17, 99, 3], [300, 2, 71, 8, 9, 10], [42, 7]]


class FullTableGraphs:
    """Stands in for DecodeGraphs: buckets up to `largest` sequences; `run` checks what the runner handed it and
    computes the step eagerly from a metadata with the page table."""

    pieces = 1
    num_piece_waits_cut = 0
    last_move_piece = None
    last_poll_gap_s = 0.0
    last_setup_s = last_plan_s = last_wait_s = 0.0  # DecodeGraphs.run's host times before the first replay

    def __init__(self, runner: Any, largest: int) -> None:
        self.runner, self.largest, self.seen = runner, largest, []
        self.batch: list[ScheduledSeq] = []  # the step being launched (the test sets it before each launch)

    def bucket(self, num_seqs: int) -> int | None:
        return self.largest if num_seqs <= self.largest else None

    def run(self, key: Any, ids: torch.Tensor, pos: torch.Tensor, metadata: Any, tables: list[list[int]],
            between: Any = None, move_pending: Any = None) -> torch.Tensor | None:
        if self.bucket(len(tables)) is None:  # as DecodeGraphs.run: too large, the runner goes eager
            return None
        self.seen.append(tuple(metadata.block_tables.shape))
        # the same step with the page table (launch advances the sequences only after the forward)
        full_ids, full_pos, full = self.runner.build_metadata(self.batch)
        assert torch.equal(full_ids, ids) and torch.equal(full_pos, pos)
        assert torch.equal(full.slot_mapping, metadata.slot_mapping) and full.seq_lens_list == metadata.seq_lens_list
        assert torch.equal(full.seq_lens, metadata.seq_lens)
        self.runner.backend.begin_batch(full)
        return self.runner.model.forward(ids, pos, AttentionContext(self.runner.backend, full))


def _greedy(largest: int | None, graphs_class: type = FullTableGraphs) -> tuple[list[list[int]], list[tuple[int, ...]]]:
    from benchmarks.gpu.engine_common import make_runner, make_seqs
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    source = resolve_source("dummy:tiny-llama")
    model = build_model(source.config, dtype=torch.float32, device="cpu")
    source.fill(model, True, 0)
    model.eval()
    runner, _ = make_runner(model, source.config, "torch", 32, 4, "cpu", torch.float32)
    graphs = None
    if largest is not None:
        graphs = runner.graphs = graphs_class(runner, largest)
    seqs = make_seqs(PROMPTS, 6, 4, 32)
    runner.collect(runner.launch([ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]))
    for _ in range(5):
        batch = [ScheduledSeq(s, 1) for s in seqs]
        if graphs is not None:
            graphs.batch = batch
        runner.collect(runner.launch(batch))
    return [list(s.output_token_ids) for s in seqs], (graphs.seen if graphs else [])


def test_a_decode_step_on_a_graph_bucket_skips_the_page_table_and_keeps_the_tokens():
    tokens, seen = _greedy(largest=4)
    assert seen == [(3, 0)] * 5  # every decode step: no page table columns
    assert tokens == _greedy(largest=None)[0]
    assert all(len(ids) == 6 for ids in tokens)


def test_a_batch_no_bucket_holds_keeps_the_page_table_for_the_eager_forward():
    tokens, seen = _greedy(largest=2)  # three sequences: too many for the graphs, the eager forward runs
    assert seen == []
    assert tokens == _greedy(largest=None)[0]


def test_build_metadata_without_the_page_table_keeps_everything_else():
    from benchmarks.gpu.engine_common import make_runner, make_seqs
    from bullet_ray.models.loader import resolve_source

    source = resolve_source("dummy:tiny-llama")
    runner, _ = make_runner(None, source.config, "torch", 32, 4, "cpu", torch.float32)
    seqs = make_seqs(PROMPTS, 6, 4, 32)
    for s in seqs:
        s.num_computed_tokens = len(s.prompt_token_ids) - 1
    batch = [ScheduledSeq(s, 1) for s in seqs]
    ids, pos, full = runner.build_metadata(batch)
    lean_ids, lean_pos, lean = runner.build_metadata(batch, page_table=False)
    assert torch.equal(ids, lean_ids) and torch.equal(pos, lean_pos)
    assert tuple(full.block_tables.shape) == (3, 8) and tuple(lean.block_tables.shape) == (3, 0)
    for name in ("query_start_loc", "seq_lens", "slot_mapping"):
        assert torch.equal(getattr(full, name), getattr(lean, name)), name
    assert (full.query_lens_list, full.seq_lens_list, full.is_decode) == \
        (lean.query_lens_list, lean.seq_lens_list, lean.is_decode)


class RefusingGraphs(FullTableGraphs):
    """A bucket holds the batch, yet `run` declines it (not expected of DecodeGraphs): the runner must rebuild the
    page table for the eager forward."""

    def run(self, key: Any, ids: torch.Tensor, pos: torch.Tensor, metadata: Any, tables: list[list[int]],
            between: Any = None, move_pending: Any = None) -> torch.Tensor | None:
        self.seen.append(tuple(metadata.block_tables.shape))
        return None


def test_a_graph_that_declines_the_step_leaves_it_to_the_eager_forward_with_the_page_table(monkeypatch):
    from bullet_ray.engine.attention.torch_ref import TorchAttentionBackend

    tables_seen: list[tuple[int, ...]] = []
    begin = TorchAttentionBackend.begin_batch
    monkeypatch.setattr(TorchAttentionBackend, "begin_batch",
                        lambda self, md: (tables_seen.append(tuple(md.block_tables.shape)), begin(self, md))[1])
    tokens, seen = _greedy(largest=4, graphs_class=RefusingGraphs)
    assert seen == [(3, 0)] * 5 and tables_seen[-5:] == [(3, 8)] * 5  # declined without, run eagerly with it
    assert tokens == _greedy(largest=None)[0]


def test_token_slots_equal_one_slot_per_token():
    """The page-wise slots of a prompt chunk equal the per-token formula, for chunks that start and end anywhere."""
    import random

    from bullet_ray.engine.runner import token_slots

    rng = random.Random(0)
    for _ in range(300):
        bs = rng.choice([1, 4, 16])
        blocks = rng.sample(range(1000), 40)
        start = rng.randrange(0, 40 * bs)
        end = rng.randrange(start, 40 * bs + 1)
        assert token_slots(blocks, start, end, bs) == [blocks[p // bs] * bs + p % bs for p in range(start, end)]
    assert token_slots([7], 3, 3, 16) == []


def test_a_step_whose_every_row_samples_skips_the_row_gather(monkeypatch):
    """A decode step (one token a row, every row sampling) computes its logits from the hidden states as they are:
    no row indices copied, no gather; a prompt step (several tokens a row) still gathers each row's last token."""
    import bullet_ray.engine.runner as runner_module
    from benchmarks.gpu.engine_common import make_runner, make_seqs
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    source = resolve_source("dummy:tiny-llama")
    model = build_model(source.config, dtype=torch.float32, device="cpu")
    source.fill(model, True, 0)
    model.eval()
    runner, _ = make_runner(model, source.config, "torch", 32, 4, "cpu", torch.float32)
    gathers: list[int] = []
    real_to_device = runner_module.to_device
    monkeypatch.setattr(runner_module, "to_device", lambda values, dtype, device: (
        gathers.append(len(values)) if dtype == torch.long and len(values) == len(PROMPTS) else None)
        or real_to_device(values, dtype, device))
    seqs = make_seqs(PROMPTS, 3, 4, 32)
    runner.collect(runner.launch([ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]))
    assert gathers == [len(PROMPTS)]  # the prompt step: each row's last token gathered
    runner.collect(runner.launch([ScheduledSeq(s, 1) for s in seqs]))
    assert gathers == [len(PROMPTS)]  # the decode step: none
    assert all(len(s.output_token_ids) == 2 for s in seqs)


def test_forward_runs_a_batch_without_sampling_or_moving_its_sequences():
    """`ModelRunner.forward` (launch's first half; the profile sweep times steps with it) may run a batch again and
    again: it leaves every sequence's counts as they were, and `launch` after it samples what the same forward gives."""
    from benchmarks.gpu.engine_common import make_runner, make_seqs
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    source = resolve_source("dummy:tiny-llama")
    model = build_model(source.config, dtype=torch.float32, device="cpu")
    source.fill(model, True, 0)
    model.eval()
    runner, _ = make_runner(model, source.config, "torch", 32, 4, "cpu", torch.float32)
    seqs = make_seqs(PROMPTS, 6, 4, 32)
    batch = [ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]
    with torch.inference_mode():
        first, again = runner.forward(batch), runner.forward(batch)
        assert [s.num_computed_tokens for s in seqs] == [0, 0, 0] and [s.num_pending_tokens for s in seqs] == [0] * 3
        assert torch.equal(first.hidden, again.hidden) and first.num_tokens == sum(len(p) for p in PROMPTS)
        assert first.ran == "eager" and first.num_groups == 1 and {"prep", "attn_plan", "forward"} <= set(first.host_s)
        step = runner.launch(batch)  # the prompts' last rows sample the argmax of the same forward's logits
        result = runner.collect(step)
    last = first.metadata.query_start_loc[1:].long() - 1
    expected = model.compute_logits(first.hidden.index_select(0, last)).argmax(dim=-1).tolist()
    assert [s.output_token_ids[-1] for s in result.sampled] == expected
    assert [s.num_computed_tokens for s in seqs] == [len(p) for p in PROMPTS]


def test_forward_looks_once_the_inputs_are_prepared_and_reads_the_graph_key_after():
    """`before_forward` (the decode worker's look at a requested split, `DecodeWorker._before_pieces`) runs after the
    inputs are built and before the forward: a partition it moves to is the one the graphs run on."""
    from benchmarks.gpu.engine_common import make_runner, make_seqs
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    source = resolve_source("dummy:tiny-llama")
    model = build_model(source.config, dtype=torch.float32, device="cpu")
    source.fill(model, True, 0)
    model.eval()
    runner, _ = make_runner(model, source.config, "torch", 32, 4, "cpu", torch.float32)
    graphs = runner.graphs = FullTableGraphs(runner, 4)
    keys: list[Any] = []
    run = graphs.run
    graphs.run = lambda key, *a, **k: (keys.append(key), run(key, *a, **k))[1]  # type: ignore[method-assign]
    seqs = make_seqs(PROMPTS, 6, 4, 32)
    order: list[str] = []
    build = runner.build_metadata
    runner.build_metadata = lambda *a, **k: (order.append("inputs"), build(*a, **k))[1]  # type: ignore[method-assign]

    def look() -> None:
        order.append("look")
        runner.graph_key = 7  # the worker followed a split to entry 7

    with torch.inference_mode():
        runner.collect(runner.launch([ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]))
        batch = [ScheduledSeq(s, 1) for s in seqs]
        graphs.batch = batch
        order.clear()
        step = runner.launch(batch, before_forward=look)
        runner.collect(step)
    assert order[:2] == ["inputs", "look"] and keys == [7] and runner.graph_key == 7
    assert "look_ms" in step.host_ms() and step.graphs == "decode"
