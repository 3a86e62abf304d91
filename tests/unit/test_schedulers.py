"""Schedulers on a fake block source: budgets, FCFS, watermark, growth and preemption. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.scheduler.chunked import ChunkedScheduler
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence


class FakeBlocks:
    def __init__(self, n: int) -> None:
        self.free_ids = list(range(n))
        self.num_blocks = n

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        out, self.free_ids = self.free_ids[:n], self.free_ids[n:]
        return out

    def free(self, ids: list[int]) -> None:
        assert not set(ids) & set(self.free_ids)
        self.free_ids += ids


@dataclass
class FakeSampling:
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)

    def append(self, token: int) -> None:
        self.output_token_ids.append(token)


def make_seq(rid: str, prompt_len: int, outputs: int = 0) -> Sequence:
    sampling = FakeSampling(SamplingParams(max_tokens=100), list(range(outputs)))
    return Sequence(rid, list(range(prompt_len)), sampling, 0.0, 4096)


def run_step(batch) -> list[Sequence]:
    """What the runner does to the scheduled sequences: advance, and sample where complete (returned)."""
    sampled = []
    for item in batch:
        complete = item.completes_known_tokens
        item.seq.num_computed_tokens += item.num_new_tokens
        if complete:
            item.seq.sampling.append(7)
            sampled.append(item.seq)
    return sampled


def test_prefill_fills_budget_fcfs_and_chunks_the_overflow():
    blocks = FakeBlocks(100)
    sched = PrefillScheduler(blocks, block_size=4, max_num_batched_tokens=10, max_num_seqs=8)
    a, b, c = make_seq("a", 6), make_seq("b", 7), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 6), ("b", 4)]
    assert len(a.block_ids) == 2 and len(b.block_ids) == 1
    run_step(batch)
    assert [i.seq.request_id for i in batch if i.seq.output_token_ids] == ["a"]
    sched.remove([a])
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("b", 3), ("c", 3)]
    assert len(b.block_ids) == 2


def test_prefill_waits_when_full_and_respects_watermark():
    blocks = FakeBlocks(4)
    sched = PrefillScheduler(blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, watermark_blocks=1)
    sched.add(make_seq("a", 12))  # 3 blocks, leaves 1 = watermark: admitted
    sched.add(make_seq("b", 4))  # 1 block would leave 0 < watermark: waits
    batch = sched.schedule()
    assert [i.seq.request_id for i in batch] == ["a"]
    assert blocks.num_free == 1


def test_decode_grows_blocks_and_preempts_the_youngest():
    blocks = FakeBlocks(3)
    sched = DecodeScheduler(blocks, block_size=2, max_num_seqs=8)
    old, young = make_seq("old", 1, outputs=1), make_seq("young", 1, outputs=1)
    for s in (old, young):  # each holds 2 tokens: 1 block, first token computed
        s.block_ids = blocks.allocate(1)
        s.num_computed_tokens = 1
        sched.add(s)
    batch, preempted = sched.schedule()
    assert [i.seq.request_id for i in batch] == ["old", "young"] and not preempted
    run_step(batch)  # both now hold 3 tokens and need a 2nd block for the 4th; only one is free
    batch, preempted = sched.schedule()
    assert [i.seq.request_id for i in batch] == ["old"]
    assert [s.request_id for s in preempted] == ["young"]
    assert young.block_ids == [] and young.num_computed_tokens == 0
    assert blocks.num_free == 1 and sched.num_preemptions == 1  # young gave its block back


def test_chunked_decodes_first_then_fills_budget_with_prompt_chunks():
    blocks = FakeBlocks(100)
    sched = ChunkedScheduler(blocks, block_size=4, max_num_batched_tokens=8, max_num_seqs=8)
    sched.add(make_seq("a", 5))
    sched.add(make_seq("b", 9))
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 5), ("b", 3)]
    run_step(batch)
    sched.after_step([i.seq for i in batch if i.seq.output_token_ids])
    assert sched.num_running == 1 and sched.num_waiting == 1
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 6)]


def test_abort_frees_blocks_everywhere():
    blocks = FakeBlocks(10)
    sched = ChunkedScheduler(blocks, block_size=4, max_num_batched_tokens=64, max_num_seqs=8)
    sched.add(make_seq("a", 9))
    sched.add(make_seq("b", 9))
    batch = sched.schedule()
    run_step(batch)
    sched.after_step([i.seq for i in batch])
    assert blocks.num_free == 4
    assert sched.abort("a") is not None and sched.abort("b") is not None
    assert sched.abort("zzz") is None
    assert blocks.num_free == 10


def _run_to_completion(num_blocks: int, block_size: int, budget: int, requests: list[tuple[int, int]],
                       max_steps: int = 500) -> tuple[bool, ChunkedScheduler, FakeBlocks]:
    """Drive a chunked scheduler until every request has its outputs (True) or a step schedules nothing."""
    blocks = FakeBlocks(num_blocks)
    sched = ChunkedScheduler(blocks, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=8)
    seqs = []
    for i, (prompt_len, max_tokens) in enumerate(requests):
        seq = Sequence(f"r{i}", list(range(prompt_len)), FakeSampling(SamplingParams(max_tokens=max_tokens)), 0.0, 4096)
        sched.add(seq)
        seqs.append(seq)
    finished: set[str] = set()
    for _ in range(max_steps):
        batch = sched.schedule()
        if not batch:
            return False, sched, blocks
        sampled = run_step(batch)
        sched.after_step(sampled)
        for seq in sampled:
            if len(seq.output_token_ids) >= seq.sampling.params.max_tokens:
                sched.finish(seq)
                finished.add(seq.request_id)
        if len(finished) == len(seqs):
            return True, sched, blocks
    return False, sched, blocks


def test_a_head_that_cannot_fit_takes_the_kv_of_a_waiting_prompt_once_nothing_runs():
    # 8 blocks of 2 tokens; r0 (3 + 11 tokens) and r1 (10 + 6) each fit alone, not together. r1's chunks hold
    # blocks while it waits; r0 preempts itself to grow, comes back first and cannot fit beside r1's blocks:
    # before, nothing was scheduled again (a stall); now r1's KV is released and recomputed later
    done, sched, blocks = _run_to_completion(8, 2, 4, [(3, 11), (10, 6)])
    assert done and blocks.num_free == 8
    assert sched.prefill.num_reclaimed >= 1 and sched.num_preemptions >= sched.prefill.num_reclaimed


def test_prefill_reclaims_only_when_it_holds_every_used_block_and_never_the_head():
    def setup(num_blocks: int):
        blocks = FakeBlocks(num_blocks)
        sched = PrefillScheduler(blocks, block_size=4, max_num_batched_tokens=12, max_num_seqs=8)
        head, partial = make_seq("head", 8), make_seq("partial", 16)
        sched.add(partial)
        assert [(i.seq.request_id, i.num_new_tokens) for i in sched.schedule()] == [("partial", 12)]  # 3 blocks
        partial.num_computed_tokens = 12
        sched.add(head, front=True)  # a preempted sequence back for recompute: 2 blocks
        return blocks, sched, head, partial

    blocks, sched, head, partial = setup(5)
    blocks.allocate(1)  # a running sequence (or one in flight) holds a block: it will free it, so wait
    assert sched.schedule() == [] and len(partial.block_ids) == 3 and sched.num_reclaimed == 0
    blocks, sched, head, partial = setup(4)  # 1 free, every other block is the queue's: nothing will free one
    # partial's KV is released (recomputed from 0), the head runs, and partial restarts in what is left
    assert [(i.seq.request_id, i.num_new_tokens) for i in sched.schedule()] == [("head", 8), ("partial", 4)]
    assert partial.num_computed_tokens == 0 and len(partial.block_ids) == 1 and sched.num_reclaimed == 1
    assert list(sched.waiting) == [head, partial]  # the order stands


def test_random_small_pools_always_finish():
    import random

    rng = random.Random(0)
    for _ in range(300):
        block_size, num_blocks, budget = rng.choice([2, 4]), rng.randint(4, 12), rng.choice([4, 8, 16, 32])
        requests = [(rng.randint(1, 20), rng.randint(1, 12)) for _ in range(rng.randint(1, 4))]
        requests = [(p, o) for p, o in requests if (p + o + block_size - 1) // block_size <= num_blocks]
        if requests:
            done, _, blocks = _run_to_completion(num_blocks, block_size, budget, requests)
            assert done and blocks.num_free == num_blocks, (num_blocks, block_size, budget, requests)


def test_random_small_pools_finish_with_a_prefill_and_a_decode_side():
    """The bullet schedule's two schedulers on one pool, stepping in turn: a preempted sequence goes back to the
    prefill queue's front, and the prefill side reclaims waiting prompts' KV only when it holds every used block;
    requests may need the whole pool, watermark included (30 of 3,000 such pools stalled before)."""
    import random

    rng = random.Random(1)
    for _ in range(300):
        block_size, num_blocks, budget = rng.choice([2, 4]), rng.randint(4, 12), rng.choice([4, 8, 16, 32])
        requests = [(rng.randint(1, 20), rng.randint(1, 12)) for _ in range(rng.randint(1, 5))]
        requests = [(p, o) for p, o in requests if (p + o + block_size - 1) // block_size <= num_blocks]
        blocks = FakeBlocks(num_blocks)
        prefill = PrefillScheduler(blocks, block_size, budget, 8, watermark_blocks=rng.choice([0, 1, 2]))
        decode = DecodeScheduler(blocks, block_size, 8)
        for i, (prompt_len, max_tokens) in enumerate(requests):
            prefill.add(Sequence(f"r{i}", list(range(prompt_len)), FakeSampling(SamplingParams(max_tokens=max_tokens)),
                                 0.0, 4096))
        finished, idle_rounds, rounds = 0, 0, 0
        while finished < len(requests):
            rounds += 1
            assert rounds < 2000, (num_blocks, block_size, budget, requests)  # no livelock either
            prompts = prefill.schedule()
            decodes, preempted = decode.schedule()
            for seq in reversed(preempted):
                prefill.add(seq, front=True)
            idle_rounds = idle_rounds + 1 if not prompts and not decodes else 0
            assert idle_rounds < 3, (num_blocks, block_size, budget, requests)  # a preemption may cost one round
            for batch, from_prefill in ((prompts, True), (decodes, False)):
                for seq in run_step(batch):
                    if from_prefill:
                        prefill.remove([seq])
                        decode.add(seq)
                    if len(seq.output_token_ids) >= seq.sampling.params.max_tokens:
                        decode.remove(seq)
                        finished += 1
        assert blocks.num_free == num_blocks


def test_a_request_that_needs_the_watermark_gets_it_once_nothing_runs():
    blocks = FakeBlocks(7)
    sched = PrefillScheduler(blocks, block_size=4, max_num_batched_tokens=32, max_num_seqs=8, watermark_blocks=2)
    sched.add(make_seq("big", 20))  # 5 blocks
    held = blocks.allocate(1)  # a running sequence: it may grow into the watermark, so "big" waits (1 < 2 left)
    assert sched.schedule() == []
    blocks.free(held)  # it finished: nothing else will use the watermark
    assert [(i.seq.request_id, i.num_new_tokens) for i in sched.schedule()] == [("big", 20)]
