"""The direct hand-off's parts in milliseconds, no model and no worker processes: the decode worker drops a
hand-off whose abort overtook it (blocks freed), the prefill worker tells the front before it hands off, the front
reads the prefill worker's messages before the decode worker's, and the two worker ends over a real socket."""

from __future__ import annotations

import threading
import time
from multiprocessing import Pipe
from multiprocessing.connection import wait
from types import SimpleNamespace

from bullet_ray.engine.front_link import RETIRED_ID_HOLD_S
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.messages import AbortRequests, ConnectHandoff, Handoff, StepOutputs
from bullet_ray.engine.sampler import SamplingState
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.scheduler.decode import DecodeScheduler
from bullet_ray.engine.scheduler.prefill import PrefillScheduler
from bullet_ray.engine.sequence import Sequence
from bullet_ray.engine.state_block import Policy
from bullet_ray.engine.worker import handoff
from bullet_ray.engine.worker.handoff import AbortTombstones, HandoffInbox, HandoffOutbox
from bullet_ray.engine.worker.roles import DecodeWorker, PrefillWorker
from bullet_ray.engine.worker.roles import prefill as prefill_role
from tests.unit.test_mixed_fallback_stall import FakeState
from tests.unit.test_schedulers import FakeBlocks


def _wire(rid: str, blocks: FakeBlocks, num_blocks: int = 2):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    seq = Sequence(rid, [1, 2, 3], SamplingState(params, [1, 2, 3]), 0.0, 64, blocks.allocate(num_blocks), 3)
    seq.output_token_ids.append(9)
    return seq.to_wire()


def _decode(blocks: FakeBlocks) -> DecodeWorker:
    d = DecodeWorker.__new__(DecodeWorker)  # only what handle / abort read
    d.config = SimpleNamespace(mixed_chunk_tokens=8, max_num_seqs=8)
    d.scheduler = DecodeScheduler(blocks, 2, 8)
    d.prompts = PrefillScheduler(blocks, 2, 8, 8, 0)
    d.allocator, d.res = blocks, SimpleNamespace(state=FakeState())
    d.tombstones, d._handoff_hops_s = AbortTombstones(), []
    d.recorder = SimpleNamespace(log=SimpleNamespace(write=lambda *a, **k: None))
    return d


def test_tombstones_forget_once_taken_after_their_hold_and_the_oldest_when_full(monkeypatch):
    stones = AbortTombstones()
    stones.add("a")
    assert stones.take("a") and not stones.take("a") and not stones.take("never")
    short = AbortTombstones(hold_s=0.0)
    short.add("b")
    time.sleep(0.001)
    assert not short.take("b")
    monkeypatch.setattr(handoff, "MAX_TOMBSTONES", 3)
    full = AbortTombstones()
    for rid in "wxyz":
        full.add(rid)
    assert len(full) == 3 and not full.take("w") and full.take("z")


def test_a_tombstone_is_gone_before_the_front_lets_its_id_be_used_again():
    """The front refuses a finished id for RETIRED_ID_HOLD_S; a tombstone lasting longer would drop the hand-off of
    a new request of the same id, which would then hang."""
    assert handoff.TOMBSTONE_HOLD_S < RETIRED_ID_HOLD_S


def test_a_hand_off_whose_abort_came_first_is_dropped_with_its_blocks():
    blocks = FakeBlocks(8)
    d = _decode(blocks)
    d.abort(["x", "p"])  # neither is here yet
    d.handle(Handoff(_wire("x", blocks), sent_s=time.time()))
    d.res.state.count_handed_prompts(Policy.PROMPTS_HANDED_OVER)  # as the prefill side does before sending
    d.handle(Handoff(_wire("p", blocks), is_prompt=True, via="front"))
    d.handle(Handoff(_wire("y", blocks), sent_s=time.time()))  # never aborted: it runs
    assert [s.request_id for s in d.scheduler.running] == ["y"] and len(d.prompts) == 0
    assert blocks.num_free == 6  # x's and p's blocks came back, y holds its 2
    assert d.res.state.num_handed_prompts_held() == 0  # the dropped prompt left decode's hands
    assert len(d._handoff_hops_s) == 2  # the timed ones (sent_s), dropped or not
    (y,) = d.scheduler.running
    d.abort(["y"])
    assert y.finish_reason == "abort" and len(d.tombstones) == 0  # held here: no tombstone


def test_through_the_front_an_abort_of_a_sequence_not_here_leaves_nothing_behind():
    """handoff: front: a hand-off and its abort come in order on the front's socket (it aborts again behind a relay
    it raced), so decode keeps no tombstones and a later hand-off of the id runs."""
    blocks = FakeBlocks(8)
    d = _decode(blocks)
    d.tombstones = None
    d.abort(["x"])
    d.handle(Handoff(_wire("x", blocks), via="front"))
    assert [s.request_id for s in d.scheduler.running] == ["x"]


class _Queue:
    waiting: list = []

    def __len__(self) -> int:
        return 0


def _prefill(monkeypatch, outbox: HandoffOutbox, wires: list) -> list:
    """A prefill worker's `process` of a collected step that sampled the first tokens of `wires` (stubs for what it
    reads besides); returns the log of (where, message) the front saw, in send order."""
    sent: list = []
    p = PrefillWorker.__new__(PrefillWorker)
    p.role, p.decider, p.allocator, p.scheduler = "prefill", None, None, _Queue()
    p.conn = SimpleNamespace(send=lambda msg: sent.append(("front", msg)))
    p.first_tokens = SimpleNamespace(sampled=lambda seqs: None)
    p.publish_step = lambda *a: None
    p.handoff_outbox = outbox
    seqs = [SimpleNamespace(finish_reason=None, to_wire=lambda w=w: w) for w in wires]
    msg = StepOutputs("prefill", [w.request_id for w in wires], [9] * len(wires), sent_s=123.0)
    monkeypatch.setattr(prefill_role, "step_outputs", lambda worker, result: (msg, []))
    p.process(SimpleNamespace(sampled=seqs), None, 0.0)
    return sent


class _Recorder(HandoffOutbox):
    def __init__(self, sent: list, fail_after: int | None = None) -> None:
        super().__init__()
        self._conn = object()  # connected
        self.sent, self.fail_after = sent, fail_after

    def send(self, msg) -> bool:
        if self.fail_after is not None and len([s for s in self.sent if s[0] == "decode"]) >= self.fail_after:
            return False
        self.sent.append(("decode", msg))
        return True


def test_the_prefill_worker_tells_the_front_before_it_hands_off(monkeypatch):
    blocks = FakeBlocks(8)
    wires = [_wire("a", blocks), _wire("b", blocks)]
    sent: list = []
    log = _prefill(monkeypatch, _Recorder(sent), wires)
    assert [w for w, _ in log] == ["front"] and [w for w, _ in sent] == ["decode", "decode"]
    front = log[0][1]
    assert front.handed_direct == ["a", "b"] and front.handoffs == [] and front.request_ids == ["a", "b"]
    # both ways time a hand-off from the step message's stamp (the front's relay copies it into its Handoff)
    assert [m.seq.request_id for _, m in sent] == ["a", "b"] and {m.sent_s for _, m in sent} == {front.sent_s} == {123.0}


def test_a_failed_direct_send_hands_the_rest_to_the_front(monkeypatch):
    blocks = FakeBlocks(8)
    wires = [_wire("a", blocks), _wire("b", blocks), _wire("c", blocks)]
    sent: list = []
    log = _prefill(monkeypatch, _Recorder(sent, fail_after=1), wires)
    assert [m.seq.request_id for _, m in sent] == ["a"]
    assert [w for w, _ in log] == ["front", "front"]
    assert [w.request_id for w in log[1][1].handoffs] == ["b", "c"]  # relayed by the front


def test_without_a_connection_hand_offs_ride_in_the_front_message(monkeypatch):
    blocks = FakeBlocks(8)
    log = _prefill(monkeypatch, HandoffOutbox(), [_wire("a", blocks)])
    (where, msg), = log
    assert where == "front" and [w.request_id for w in msg.handoffs] == ["a"] and msg.handed_direct == []


def _front() -> LLMEngine:
    front = LLMEngine.__new__(LLMEngine)  # only what the receive loop and the hand-off handlers read
    front._lock, front._requests, front._is_shut_down = threading.Lock(), {}, False
    front.num_direct_handoffs = 0
    front.hop_handoff_s = []
    return front


def test_the_front_reads_every_prefill_message_before_the_decode_workers_next():
    front = _front()
    pre_recv, pre_send = Pipe(duplex=False)
    dec_recv, dec_send = Pipe(duplex=False)
    front._conns = {"prefill": pre_recv, "decode": dec_recv}
    seen: list[str] = []

    def on_message(msg) -> None:
        seen.append(msg)
        if len(seen) == 4:
            front._is_shut_down = True

    front._on_message = on_message
    front._observe_prefill_step = lambda: None
    # the prefill worker's messages were sent before the decode worker's (the hand-off's causal order)
    for m in ("p1", "p2", "p3"):
        pre_send.send(m)
    dec_send.send("d1")
    loop = threading.Thread(target=front._receive_loop, daemon=True)
    loop.start()
    loop.join(5)
    front._is_shut_down = True
    assert seen == ["p1", "p2", "p3", "d1"]


def test_a_direct_hand_off_moves_aborts_to_decode_and_aborts_one_already_gone():
    front = _front()
    sent: list = []
    front._send = lambda role, msg: sent.append((role, msg))
    front._requests["a"] = SimpleNamespace(location="prefill")
    front._on_direct_handoff("a")
    front._on_direct_handoff("gone")  # finished or aborted while prefilled
    assert front._requests["a"].location == "decode"
    assert sent == [("decode", AbortRequests(["gone"]))]


def _connected(inbox: HandoffInbox, word):
    """The prefill worker's connection, once the accept thread's word of it (`word`, what `connections` gave before
    the prefill worker connected) has come and been taken."""
    assert wait([word], 5) == [word] and inbox.receive(word) is None  # it came; nothing to dispatch
    (conn,) = inbox.connections()
    assert conn is not word
    return conn


def test_a_wait_begun_before_the_prefill_worker_connects_wakes_up_for_it(tmp_path):
    """The decode worker waits on the front's connection and `connections()`; a prefill worker connecting while it
    waits wakes it at once (not at the wait's timeout), and its hand-offs are waited on from then."""
    key = b"k" * 16
    inbox = HandoffInbox(str(tmp_path), key)
    front_r, front_w = Pipe(duplex=False)
    woke: list = []
    waiter = threading.Thread(target=lambda: woke.append((wait([front_r, *inbox.connections()], 5),
                                                          time.monotonic())))
    waiter.start()
    time.sleep(0.1)
    connected_at = time.monotonic()
    outbox = HandoffOutbox()
    outbox.connect(inbox.address, key)
    waiter.join(6)
    (ready, woke_at), = woke
    assert woke_at - connected_at < 1.0 and front_r not in ready
    (word,) = ready
    assert inbox.receive(word) is None
    (conn,) = inbox.connections()
    assert outbox.send(Handoff(_wire("a", FakeBlocks(2)), sent_s=1.0))
    assert wait([front_r, *inbox.connections()], 5) == [conn] and inbox.receive(conn).seq.request_id == "a"
    outbox.close()
    inbox.close()
    front_r.close()
    front_w.close()


def test_an_inbox_closed_before_anyone_connects_stops_its_thread_and_socket(tmp_path):
    inbox = HandoffInbox(str(tmp_path), b"k" * 16)
    inbox.close()
    assert not inbox._thread.is_alive() and inbox.connections() == []
    assert not (tmp_path / "handoff.sock").exists()


def test_the_two_ends_connect_over_the_runtime_folder_and_carry_a_hand_off(tmp_path):
    key = b"k" * 16
    inbox = HandoffInbox(str(tmp_path), key)
    assert ConnectHandoff(inbox.address).address.endswith("handoff.sock")
    (word,) = inbox.connections()  # until the prefill worker connects, the decode worker waits on this
    outbox = HandoffOutbox()
    outbox.connect(inbox.address, key)
    assert outbox.is_connected
    conn = _connected(inbox, word)
    assert not (tmp_path / "handoff.sock").exists()  # one peer: the listener is gone
    assert outbox.send(Handoff(_wire("a", FakeBlocks(2)), sent_s=1.0))
    assert inbox.receive(conn).seq.request_id == "a"
    outbox.close()
    assert inbox.receive(conn) is None and inbox.connections() == []  # the prefill side went away
    assert not outbox.send(Handoff(_wire("b", FakeBlocks(2))))
    inbox.close()


def test_a_wrong_key_does_not_connect_and_the_prefill_worker_still_can(tmp_path):
    inbox = HandoffInbox(str(tmp_path), b"a" * 16)
    stray = HandoffOutbox()
    stray.connect(inbox.address, b"b" * 16)
    assert not stray.is_connected  # turned away, and no word of a connection: the listener waits for the next
    (word,) = inbox.connections()
    assert not wait([word], 0.2)
    outbox = HandoffOutbox()
    outbox.connect(inbox.address, b"a" * 16)
    assert outbox.is_connected and _connected(inbox, word) is not None
    outbox.close()
    inbox.close()
    assert inbox.connections() == []
