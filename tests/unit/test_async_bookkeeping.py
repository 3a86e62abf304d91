"""One-step-late bookkeeping without processes: held-back frees, pending tokens, the runner's gather.

`DeferredFree` keeps blocks freed during an in-flight step away from the shared pool (another worker)
until the host has seen that step finish, while this worker may reuse them at once. The runner feeds a
token still on the device into the next step by a gather; greedy output equals a synchronous run.
"""

from __future__ import annotations

import torch

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.deferred_free import DeferredFree
from tests.unit.test_schedulers import FakeBlocks, make_seq


def test_frees_during_a_step_are_held_back_until_it_finishes():
    shared = FakeBlocks(10)
    blocks = DeferredFree(shared)
    ids = blocks.allocate(4)
    assert ids is not None and shared.num_free == 6
    blocks.on_launch()  # step 1 in flight
    blocks.free(ids[:2])
    assert shared.num_free == 6 and blocks.num_free == 8  # parked: this worker may reuse them
    again = blocks.allocate(1)
    assert again == [ids[1]] and shared.num_free == 6  # parked blocks first
    blocks.on_launch()  # step 2 in flight, step 1 too
    blocks.free(ids[2:])  # freed while step 2 may still write them: gated by step 2
    blocks.on_complete()  # step 1 finished
    assert shared.num_free == 7 and blocks.num_parked == 2
    blocks.on_complete()  # step 2 finished
    assert shared.num_free == 9 and blocks.num_parked == 0
    blocks.free(again)  # nothing in flight: straight back
    assert shared.num_free == 10


def test_allocate_all_or_nothing_across_parked_and_shared():
    shared = FakeBlocks(4)
    blocks = DeferredFree(shared)
    ids = blocks.allocate(3)
    blocks.on_launch()
    blocks.free(ids[:1])
    assert blocks.allocate(3) is None and blocks.num_parked == 1 and shared.num_free == 1
    got = blocks.allocate(2)
    assert got is not None and sorted(got) == sorted([ids[0], 3])


def test_decode_scheduler_skips_a_sequence_whose_pending_token_ends_it():
    sched = DecodeScheduler(FakeBlocks(100), block_size=4, max_num_seqs=8)
    a, b = make_seq("a", 5), make_seq("b", 5)
    a.sampling.params = SamplingParams(max_tokens=1)
    for seq in (a, b):
        seq.num_computed_tokens, seq.num_pending_tokens = 5, 1
        sched.add(seq)
    batch, preempted = sched.schedule()
    assert [item.seq.request_id for item in batch] == ["b"] and not preempted
    assert a.is_length_capped and not b.is_length_capped


def test_runner_gathers_pending_tokens_and_matches_a_synchronous_run():
    from benchmarks.gpu.engine_common import make_runner
    from bullet_ray.models.loader import resolve_source
    from bullet_ray.models.registry import build_model

    source = resolve_source("dummy:tiny-llama")
    model = build_model(source.config, dtype=torch.float32, device="cpu")
    source.fill(model, True, 0)
    model.eval()
    prompts = [[5, 17, 99, 3], [300, 2, 71, 8, 9, 10]]

    def run(is_async: bool) -> tuple[list[list[int]], list]:
        from benchmarks.gpu.engine_common import make_seqs

        runner, _ = make_runner(model, source.config, "torch", 16, 4, "cpu", torch.float32)
        seqs = make_seqs(prompts, 8, 4, 32)
        seqs[0].sampling.params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
        logprobs = []
        inflight = runner.launch([ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs])
        for _ in range(7):
            if not is_async:
                logprobs.append(runner.collect(inflight).logprobs["r0"])
            assert all(s.num_pending_tokens == (1 if is_async else 0) for s in seqs)
            nxt = runner.launch([ScheduledSeq(s, 1) for s in seqs])
            if is_async:
                logprobs.append(runner.collect(inflight).logprobs["r0"])
            inflight = nxt
        logprobs.append(runner.collect(inflight).logprobs["r0"])
        return [list(s.output_token_ids) for s in seqs], logprobs

    tokens, logprobs = run(True)
    assert (tokens, logprobs) == run(False)
    assert all(len(ids) == 8 for ids in tokens)
    assert [lp.token_id for lp in logprobs] == tokens[0] and all(len(lp.top) == 2 for lp in logprobs)


def _worker_stub(role: str, is_gpu: bool, graphs: object, num_running: int, num_waiting: int = 0,
                 piecewise_tokens: int = 0, budget: int = 2048, num_prompts: int = 0,
                 covered: bool = True) -> object:
    """A worker with only the attributes the launch-ahead rule reads (no process, no model)."""
    from types import SimpleNamespace

    from bullet_ray.engine.layerwise import LayerGroups
    from bullet_ray.engine.piecewise_graphs import token_buckets
    from bullet_ray.engine.worker.roles import DecodeWorker, HybridWorker, PrefillWorker

    cls = {"prefill": PrefillWorker, "decode": DecodeWorker, "hybrid": HybridWorker}[role]
    stub = cls.__new__(cls)
    stub.config = SimpleNamespace(is_gpu=is_gpu, max_num_batched_tokens=budget, mixed_chunk_tokens=budget)
    buckets = token_buckets(piecewise_tokens)
    piecewise = SimpleNamespace(bucket=lambda n: next((b for b in buckets if b >= n), None),
                                covers=lambda key: covered) if buckets else None
    stub.runner = SimpleNamespace(graphs=graphs, piecewise=piecewise)
    stub.partitioner = SimpleNamespace(current_index=0)
    stub.scheduler = _FakeQueue(num_running, num_waiting)
    stub.prompts = [None] * num_prompts  # a decode side's handed-over prompts (mixed fallback)
    stub.layer_groups = LayerGroups(4, 4096)
    return stub


class _FakeQueue:
    """len() and the counts of the decode and chunked schedulers."""

    def __init__(self, num_running: int, num_waiting: int) -> None:
        self.num_running, self.num_waiting = num_running, num_waiting

    def __len__(self) -> int:
        return self.num_running


def test_only_graph_steps_launch_ahead_of_the_collect_on_gpu():
    """An eager step's launch can block on the device's queue, so the step in flight is collected first;
    a decode graph replay or a step through piecewise graphs launches ahead. On CPU every step launches
    ahead (the async path stays tested)."""
    from types import SimpleNamespace

    from bullet_ray.engine.cuda_graphs import graph_buckets
    from bullet_ray.engine.scheduler.base import ScheduledSeq

    buckets = graph_buckets(64)
    graphs = SimpleNamespace(bucket=lambda n: next((b for b in buckets if b >= n), None))
    may_block = lambda w: w._next_launch_may_block()  # noqa: E731
    assert not may_block(_worker_stub("decode", True, graphs, 40))
    assert may_block(_worker_stub("decode", True, graphs, 65))  # past the largest graph: eager
    assert may_block(_worker_stub("decode", True, None, 4))  # enforce_eager: no graphs
    # a decode side with handed-over prompts (mixed fallback): through piecewise graphs only on a partition they
    # were captured for (its whole-GPU entry)
    assert may_block(_worker_stub("decode", True, graphs, 8, num_prompts=2))
    assert not may_block(_worker_stub("decode", True, graphs, 8, num_prompts=2, piecewise_tokens=2048))
    assert may_block(_worker_stub("decode", True, graphs, 8, num_prompts=2, piecewise_tokens=2048, covered=False))
    assert not may_block(_worker_stub("hybrid", True, graphs, 8, num_waiting=0))  # decode-only step
    assert may_block(_worker_stub("hybrid", True, graphs, 8, num_waiting=3))  # prompt chunks, no piecewise
    # piecewise graphs up to the budget hold every mixed step; below it a full step could be eager
    assert not may_block(_worker_stub("hybrid", True, graphs, 8, num_waiting=3, piecewise_tokens=2048))
    assert may_block(_worker_stub("hybrid", True, graphs, 8, num_waiting=3, piecewise_tokens=1024))
    assert may_block(_worker_stub("hybrid", True, graphs, 3000, num_waiting=3, piecewise_tokens=2048))
    assert not may_block(_worker_stub("hybrid", False, None, 8, num_waiting=3))  # CPU
    # the prefill side plans first, then asks of the planned batch
    prefill = _worker_stub("prefill", True, None, 0, piecewise_tokens=2048)
    assert not may_block(prefill) and not may_block(_worker_stub("prefill", False, None, 0))

    def batch(num_tokens):
        return [ScheduledSeq(SimpleNamespace(), num_tokens)]

    assert not prefill.batch_runs_eagerly(batch(1500))
    assert prefill.batch_runs_eagerly(batch(2049))  # past the largest piecewise bucket
    assert prefill.batch_runs_eagerly(batch(5000))  # layer-wise: collected first, waits between groups
    assert _worker_stub("prefill", True, None, 0).batch_runs_eagerly(batch(16))  # no piecewise graphs
    assert not _worker_stub("hybrid", True, graphs, 8, piecewise_tokens=16).batch_runs_eagerly(batch(5000))
