"""The bullet schedule's two sides on one KV pool under the mixed fallback, on CPU in milliseconds.

The real `PrefillWorker.plan` / `DecodeWorker.plan` and `after_launch` run on stubs of what they read (no model,
no processes): the prefill worker hands its queue to the decode worker while the fallback is on, as wires through
a stand-in for the front, and both sides' schedulers share one fake pool. A step computes its batch at once (the
runner's bookkeeping, without a model). Before the fix the two sides could each hold a prompt prefilled part-way
and wait for each other's blocks forever.
"""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

from bullet_ray.engine.expiring_ids import ExpiringIds
from bullet_ray.engine.front_link import MAX_RETIRED_IDS, RETIRED_ID_HOLD_S
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.messages import AbortRequests, AddRequest, Handoff
from bullet_ray.engine.sampler import SamplingState
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.scheduler.base import release
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.worker.roles import DecodeWorker, PrefillWorker, sequence_from_request
from tests.unit.test_schedulers import FakeBlocks


class FakeState:
    """The state block's policy slots (the hand-over counters live there) and its rows (the entry of each side's
    oldest step in flight)."""

    def __init__(self) -> None:
        from bullet_ray.engine.state_block import Field, Policy

        self.policy = [0] * int(Policy.NUM_SLOTS)
        self.rows = [[0] * int(Field.NUM_FIELDS) for _ in range(2)]

    def __getattr__(self, name: str):
        from bullet_ray.engine.state_block import StateBlock

        return getattr(StateBlock, name).__get__(self)  # the real methods over this list


class Outbox:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


class FakeDecider:
    """The prefill worker's decider: whether the mixed fallback is on is the test's to say."""

    def __init__(self) -> None:
        self.is_mixed = False

    def decide(self) -> None:
        pass

    def note_prompts_handed_over(self) -> None:
        pass

    def wait_to_grow(self, batch) -> float:
        return 0.0


def _identity(batch):
    return batch


class TwoSides:
    """Both workers' planning on one pool; `round` runs one step of each and delivers their messages."""

    def __init__(self, num_blocks: int, block_size: int, budget: int, chunk_tokens: int,
                 watermark_blocks: int = 0) -> None:
        self.blocks = FakeBlocks(num_blocks)
        state = FakeState()
        self.block_size = block_size
        p = PrefillWorker.__new__(PrefillWorker)  # only what plan / after_launch / hand-over read
        p.scheduler = PrefillScheduler(self.blocks, block_size, budget, 8, watermark_blocks)
        p.decider, p.conn, p.res = FakeDecider(), Outbox(), SimpleNamespace(state=state)
        p.partitioner = SimpleNamespace(current=SimpleNamespace(prefill_sms=1))
        p.first_tokens = SimpleNamespace(scheduled=lambda batch: None, forget=lambda ids: None)
        p.follow_split = lambda *args, **kwargs: None
        p._finish_inflight = lambda: None
        p.inflight = None
        p.predicted, p._next_record = _identity, None
        d = DecodeWorker.__new__(DecodeWorker)
        d.config = SimpleNamespace(mixed_chunk_tokens=chunk_tokens, max_num_seqs=8)
        d.scheduler = DecodeScheduler(self.blocks, block_size, 8)
        d.prompts = PrefillScheduler(self.blocks, block_size, budget, 8, watermark_blocks)
        d.conn, d.res, d.inflight, d.preempted, d._num_without_slot = Outbox(), SimpleNamespace(state=state), None, [], 0
        d.tombstones, d._handoff_hops_s, d.allocator = None, [], self.blocks  # handoff: front (the relay)
        d.predicted, d._next_record = _identity, None
        d._order_prompts = lambda: None  # first come, first served here (the real order needs the model)
        # the disjoint protocol (after_launch reads it; no step here shares SMs with the other side's)
        p.switch = d.switch = SimpleNamespace(overlap=False, epoch=lambda: 0, shares_sms=lambda *a: False)
        self.prefill, self.decode = p, d
        self.num_finished = 0

    def add(self, rid: str, prompt_len: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.prefill.scheduler.add(Sequence(rid, list(range(prompt_len)), SamplingState(params, list(range(prompt_len))),
                                            0.0, 4096))

    def holdings(self) -> dict[str, list[tuple[str, int]]]:
        """(request, blocks held) of each queue and the running set, for a failing assertion."""
        queues = {"prefill": self.prefill.scheduler.waiting, "decode prompts": self.decode.prompts.waiting,
                  "decode running": self.decode.scheduler.running}
        return {name: [(s.request_id, len(s.block_ids)) for s in seqs] for name, seqs in queues.items()}

    def round(self, is_mixed: bool) -> bool:
        """One planned step on each side (each computed at once); False when neither side ran anything."""
        self.prefill.decider.is_mixed = is_mixed
        ran = False
        for worker in (self.prefill, self.decode):
            batch = worker.plan()
            self._deliver()
            if not batch:
                continue
            ran = True
            sampled = []
            for item in batch:
                seq = item.seq
                complete = item.completes_known_tokens
                seq.num_computed_tokens += item.num_new_tokens
                if complete:
                    seq.output_token_ids.append(7)
                    sampled.append(seq)
            worker.after_launch(SimpleNamespace(sampled=sampled))
            for seq in sampled:  # what `process` does with the collected step
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    self.num_finished += 1
                    if worker is self.prefill:
                        release(seq, self.blocks)
                    else:
                        self.decode.scheduler.remove(seq)
                elif worker is self.prefill:
                    self.decode.handle(Handoff(seq.to_wire()))  # prefilled: on to decode
        return ran

    def run_until_finished(self, num: int, rounds: int = 50) -> None:
        """Rounds without the fallback until `num` requests finished; fails after 3 rounds in a row that ran
        nothing (a stall), with what each queue holds."""
        idle = 0
        for _ in range(rounds):
            idle = 0 if self.round(is_mixed=False) else idle + 1
            assert idle < 3, self.holdings()
            if self.num_finished == num:
                break
        assert self.num_finished == num and self.blocks.num_free == self.blocks.num_blocks

    def _deliver(self) -> None:
        """The front: the prefill worker's hand-overs to decode, decode's preempted sequences back to prefill."""
        for msg in self.prefill.conn.sent:
            for wire in msg.handoffs:
                self.decode.handle(Handoff(wire))
            for wire in msg.prompts_handed_over:
                self.decode.handle(Handoff(wire, is_prompt=True))
        for msg in self.decode.conn.sent:
            for wire in msg.preempted:
                add = AddRequest(wire.request_id, wire.prompt_token_ids, SamplingParams(), 0.0, 4096, resume=wire)
                self.prefill.scheduler.add(sequence_from_request(add), front=True)
        self.prefill.conn.sent.clear()
        self.decode.conn.sent.clear()


def test_both_sides_holding_a_prompt_part_way_do_not_block_each_other():
    # 8 blocks of 2 tokens; A and B (12 + 2 tokens: 7 blocks) each fit alone, not together. The mixed fallback
    # hands A to decode, which prefills it 4 tokens a step; then it ends, B arrives and the prefill side chunks
    # it 4 tokens a step too: A and B hold 4 blocks each, neither can grow, and neither side's queue holds every
    # used block (before: nothing was scheduled again)
    sides = TwoSides(num_blocks=8, block_size=2, budget=4, chunk_tokens=4)
    sides.add("A", 12, 2)
    assert sides.round(is_mixed=True)  # A handed over; decode prefills its first chunk
    assert len(sides.decode.prompts) == 1 and len(sides.decode.prompts.waiting[0].block_ids) == 2
    sides.add("B", 12, 2)
    sides.run_until_finished(2)
    assert sides.prefill.res.state.num_handed_prompts_held() == 0


def test_a_prefilled_sequence_waiting_for_a_block_on_decode_does_not_block_a_prompt_part_way():
    # without the fallback: A (4 + 3 tokens) is prefilled and handed off with 2 blocks, B (14 + 2) is chunked to
    # 12 tokens beside it and the pool is full. A needs a 3rd block to decode. Before, every hand-off joined the
    # decode side's prompt queue, where A waited for a block without ever being preempted (nothing was scheduled
    # again); in the running set it is preempted, and its recompute makes the prefill queue release B's KV
    sides = TwoSides(num_blocks=8, block_size=2, budget=16, chunk_tokens=16)
    sides.add("A", 4, 3)
    sides.add("B", 14, 2)
    sides.run_until_finished(2)
    assert sides.prefill.scheduler.num_reclaimed == 1  # B's KV went to A; B recomputed


def test_random_small_pools_finish_with_the_mixed_fallback_going_on_and_off():
    """Requests of a quarter to all of the pool arrive over time while the mixed fallback turns on and off at
    random; every request finishes and every block comes back, on pools that hold one request (watermark
    included); on the code before the fix some runs of this seed stalled."""
    rng = random.Random(2)
    for case in range(300):
        block_size, num_blocks = rng.choice([2, 4]), rng.randint(4, 12)
        budget, chunk, pool = rng.choice([2, 4, 8]), rng.choice([2, 4, 8]), block_size * num_blocks
        requests = []
        for _ in range(rng.randint(2, 6)):
            max_tokens = rng.randint(1, 6)
            requests.append((rng.randint(max(1, pool // 4), max(1, pool - max_tokens)), max_tokens))
        requests = [(p, o) for p, o in requests if (p + o + block_size - 1) // block_size <= num_blocks]
        arrivals = sorted(rng.randint(0, 20) for _ in requests)
        sides = TwoSides(num_blocks, block_size, budget, chunk, watermark_blocks=rng.choice([0, 1, 2]))
        is_mixed, idle, added = False, 0, 0
        for rnd in range(2000):
            while added < len(requests) and arrivals[added] <= rnd:
                sides.add(f"r{added}", *requests[added])
                added += 1
            if rng.random() < (0.6 if is_mixed else 0.2):  # on for ~2 rounds, off for ~5
                is_mixed = not is_mixed
            idle = 0 if sides.round(is_mixed) else idle + 1
            assert idle < 3 or added < len(requests), (case, num_blocks, block_size, budget, chunk, requests,
                                                       sides.holdings())
            if sides.num_finished == len(requests):
                break
        assert sides.num_finished == len(requests), (case, num_blocks, block_size, budget, chunk, requests)
        assert sides.blocks.num_free == num_blocks
        assert sides.prefill.res.state.num_handed_prompts_held() == 0


def test_prompts_handed_over_are_counted_until_prefilled_aborted_or_dropped_in_transit():
    """The prefill side waits while any prompt it handed over is held on decode or in transit; an abort on the
    decode side and the front dropping a hand-over (its request gone) count as leaving decode's hands."""
    sides = TwoSides(num_blocks=16, block_size=2, budget=4, chunk_tokens=4)
    for rid in ("a", "b", "c"):
        sides.add(rid, 8, 2)
    sides.prefill.decider.is_mixed = True
    assert sides.prefill.plan() == []  # all three handed over, none delivered yet
    state, (msg,) = sides.prefill.res.state, sides.prefill.conn.sent
    assert state.num_handed_prompts_held() == 3 and not msg.handoffs
    sides.prefill.decider.is_mixed = False
    sides.prefill.conn.sent.clear()
    sides.add("d", 4, 1)
    assert sides.prefill.plan() == []  # "d" waits: decode has not even received them
    front = LLMEngine.__new__(LLMEngine)  # only what _on_handoff reads
    front._lock, front._requests, front.allocator, front.state = threading.Lock(), {}, sides.blocks, state
    front._on_handoff(msg.prompts_handed_over[0], is_prompt=True)  # "a" aborted at the front meanwhile
    for wire in msg.prompts_handed_over[1:]:
        sides.decode.handle(Handoff(wire, is_prompt=True))
    assert state.num_handed_prompts_held() == 2
    sides.decode.abort(["b"])
    assert state.num_handed_prompts_held() == 1
    while state.num_handed_prompts_held():  # "c" is prefilled on decode
        assert sides.round(is_mixed=False)
    assert [item.seq.request_id for item in sides.prefill.plan()] == ["d"]


def test_an_abort_racing_a_hand_off_at_the_front_still_reaches_decode():
    """The front relabels a hand-off's request as on decode under its lock and sends the Handoff after it; an
    abort in between is sent to decode first and misses there. The front then sends the abort again behind the
    Handoff, so decode drops the request (and, under the fallback, counts the handed prompt done)."""
    sides = TwoSides(num_blocks=16, block_size=2, budget=4, chunk_tokens=4)
    sides.add("a", 8, 2)
    sides.prefill.decider.is_mixed = True
    assert sides.prefill.plan() == []
    state, (msg,) = sides.prefill.res.state, sides.prefill.conn.sent
    sides.prefill.conn.sent.clear()
    front = LLMEngine.__new__(LLMEngine)  # only what _on_handoff and abort read
    front._lock, front.allocator, front.state = threading.Lock(), sides.blocks, state
    front._retired_ids = ExpiringIds(RETIRED_ID_HOLD_S, MAX_RETIRED_IDS)
    front._requests = {"a": SimpleNamespace(location="prefill", sink=SimpleNamespace(put=lambda out: None),
                                            make_output=lambda *a, **k: None)}
    sent: list[tuple[str, object]] = []

    def send(role: str, out: object) -> None:
        if isinstance(out, Handoff) and "a" in front._requests:
            front.abort("a")  # the client's abort lands between the relabel and this send: it goes first
        sent.append((role, out))
        if isinstance(out, Handoff):
            sides.decode.handle(out)
        elif isinstance(out, AbortRequests):
            sides.decode.abort(out.request_ids)

    front._send = send
    front._on_handoff(msg.prompts_handed_over[0], is_prompt=True)
    assert [type(m).__name__ for _, m in sent] == ["AbortRequests", "Handoff", "AbortRequests"]
    assert len(sides.decode.prompts) == 0 and state.num_handed_prompts_held() == 0
