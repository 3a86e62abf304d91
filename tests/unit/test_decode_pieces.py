"""Decode steps in pieces on CPU, on fakes. `DecodeGraphs._run_pieces` (bullet_ray.engine.cuda_graphs) on fake graphs
and events: each piece after the second waits for the piece two before it, the hook runs at every boundary, and a step
that moves runs the rest of its pieces from the new partition's graphs (the last piece's output is the step's), on the
new stream, ordered after the old one. `DecodeWorker._between_pieces` on a stub worker: the step before is collected
only once it has finished, and the entry published for the step in flight moves one boundary after the split does.
The real graphs: tests/gpu/test_decode_pieces_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bullet_ray.engine import cuda_graphs
from bullet_ray.engine.cuda_graphs import DecodeGraphs, StepGraph
from bullet_ray.engine.layerwise import group_bounds


class FakeGraph:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def replay(self) -> None:
        self.log.append(f"replay {self.name}")


class FakeStream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(f"{self.name} waits for {other.name}")


class FakeCuda:
    """torch.cuda's events and current stream as the pieces' launch uses them, logged."""

    def __init__(self, log: list[str], stream: FakeStream) -> None:
        self.log, self.stream, self.num_events = log, stream, 0
        self.busy: dict[int, int] = {}  # event -> queries that find its piece still running (`query`)
        cuda = self

        class Event:
            def __init__(self) -> None:
                self.id = cuda.num_events
                cuda.num_events += 1

            def record(self) -> None:
                pass

            def synchronize(self) -> None:
                cuda.log.append(f"wait end {self.id}")

            def query(self) -> bool:
                cuda.log.append(f"query end {self.id}")
                if cuda.busy.get(self.id, 0) > 0:
                    cuda.busy[self.id] -= 1
                    return False
                return True

        self.Event = Event

    def current_stream(self) -> FakeStream:
        return self.stream

    def set_stream(self, stream: FakeStream) -> None:
        self.log.append(f"set {stream.name}")
        self.stream = stream


def _graphs(pieces: int, log: list[str]) -> tuple[DecodeGraphs, dict[int, StepGraph]]:
    graphs = object.__new__(DecodeGraphs)  # only what _run_pieces reads: no model, no GPU
    steps = {key: StepGraph([FakeGraph(f"p{key}.{i}", log) for i in range(pieces)],  # type: ignore[misc]
                            torch.full((8, 2), float(key))) for key in (0, 1)}
    graphs.graphs = {(key, 8, "plan"): step for key, step in steps.items()}
    graphs.pieces, graphs.num_piece_moves, graphs.num_piece_moves_missing, graphs.is_serving = pieces, 0, 0, True
    graphs.num_piece_waits_cut = 0
    return graphs, steps


@pytest.fixture
def fake(monkeypatch):
    log: list[str] = []
    cuda = FakeCuda(log, FakeStream("s0", log))
    monkeypatch.setattr(cuda_graphs.torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(cuda_graphs.torch.cuda, "set_stream", cuda.set_stream)
    return log, cuda


def test_pieces_launch_just_in_time_and_stay_put(fake):
    log, _ = fake
    graphs, steps = _graphs(4, log)
    calls = []

    def between() -> tuple[Any, Any]:
        calls.append(len(log))
        log.append("hook")
        return 0, None

    out = graphs._run_pieces(0, 8, "plan", steps[0], between)
    assert out is steps[0]
    assert log == ["replay p0.0", "hook", "replay p0.1", "wait end 0", "hook", "replay p0.2", "wait end 1", "hook",
                   "replay p0.3"]
    assert graphs.num_piece_moves == 0 and graphs.last_move_piece is None


def test_a_move_runs_the_rest_from_the_new_partitions_graphs(fake):
    log, cuda = fake
    graphs, steps = _graphs(4, log)
    new = FakeStream("s1", log)
    out = graphs._run_pieces(0, 8, "plan", steps[0], lambda: (1, new) if len(log) >= 3 else (0, None))
    assert out is steps[1]  # the step's hidden states: the last piece's, from partition 1's graphs
    assert log == ["replay p0.0", "replay p0.1", "wait end 0", "s1 waits for s0", "set s1", "replay p1.2",
                   "wait end 1", "replay p1.3"]
    assert cuda.stream is new and graphs.num_piece_moves == 1 and graphs.last_move_piece == 2  # moved_at_piece


def test_a_move_to_a_partition_without_the_graph_finishes_on_the_old_graphs(fake):
    """Never expected (every partition's graphs are captured at start), but never a capture inside a step: the rest of
    the step replays the graphs it began with, ordered on the stream the worker moved to, and it is counted."""
    log, cuda = fake
    graphs, steps = _graphs(3, log)
    del graphs.graphs[(1, 8, "plan")]
    graphs.num_piece_moves_missing = 0
    new = FakeStream("s1", log)
    out = graphs._run_pieces(0, 8, "plan", steps[0], lambda: (1, new))
    assert out is steps[0] and log == ["replay p0.0", "s1 waits for s0", "set s1", "replay p0.1", "wait end 0",
                                       "replay p0.2"]
    assert graphs.num_piece_moves == 0 and graphs.num_piece_moves_missing == 2


def test_a_split_requested_while_the_host_waits_cuts_the_wait_and_moves_at_once(fake):
    """With `move_pending` the wait for piece i - 2 is polled: a split requested while piece 0 still runs moves the
    step at the next boundary without waiting for it (piece 2 ordered after the old stream, one more piece queued);
    the next wait, with nothing pending (the worker's guard after a move), runs until its piece has finished."""
    log, cuda = fake
    graphs, steps = _graphs(5, log)
    cuda.busy = {0: 10**6, 1: 2}  # piece 0 still runs when the host reaches piece 2; piece 1 for two more polls
    new = FakeStream("s1", log)
    moved = []

    def between() -> tuple[Any, Any]:
        if "query end 0" in log:
            moved.append(True)
        return (1, new) if moved else (0, None)

    out = graphs._run_pieces(0, 8, "plan", steps[0], between, lambda: not moved)
    assert out is steps[1]
    assert log == ["replay p0.0", "replay p0.1", "query end 0", "s1 waits for s0", "set s1", "replay p1.2",
                   "query end 1", "query end 1", "query end 1", "replay p1.3", "wait end 2", "replay p1.4"]
    assert graphs.num_piece_waits_cut == 1 and graphs.num_piece_moves == 1 and graphs.last_move_piece == 2


def test_the_last_boundarys_wait_is_never_cut(fake):
    """A split requested during the wait before the last piece is followed once it has finished (after the last
    boundary there is none where the old pieces would be seen to finish)."""
    log, cuda = fake
    graphs, steps = _graphs(3, log)
    cuda.busy = {0: 10**6}
    new = FakeStream("s1", log)
    out = graphs._run_pieces(0, 8, "plan", steps[0], lambda: (1, new) if "replay p0.1" in log else (0, None),
                             lambda: True)
    assert out is steps[1]
    assert log == ["replay p0.0", "replay p0.1", "wait end 0", "s1 waits for s0", "set s1", "replay p1.2"]
    assert graphs.num_piece_waits_cut == 0 and graphs.num_piece_moves == 1


def test_a_cut_wait_the_hook_does_not_follow_leaves_the_steps_later_waits_whole(fake):
    """A request the hook does not move for (e.g. a target the ladder cannot serve) cuts one wait; the step's later
    waits are whole again (no spinning on a request that stays pending)."""
    log, cuda = fake
    graphs, steps = _graphs(4, log)
    cuda.busy = {0: 10**6}  # piece 0 still runs when the host reaches piece 2
    out = graphs._run_pieces(0, 8, "plan", steps[0], lambda: (0, None), lambda: True)
    assert out is steps[0]
    assert log == ["replay p0.0", "replay p0.1", "query end 0", "replay p0.2", "wait end 1", "replay p0.3"]
    assert graphs.num_piece_waits_cut == 1 and graphs.num_piece_moves == 0


def test_piece_bounds_cover_the_layers():
    """Decode pieces take the layer-wise prefill's groups (DecodeGraphs.bounds)."""
    assert group_bounds(32, 8) == [(i, i + 4) for i in range(0, 32, 4)]
    assert group_bounds(4, 8) == [(0, 1), (1, 2), (2, 3), (3, 4)]  # never more pieces than layers


class _Partitioner:
    side = "decode"

    def __init__(self) -> None:
        self.current_index = 0

    def current_stream(self, side: str) -> str:
        return f"stream{self.current_index}"


class _State:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def set_inflight_index(self, side: Any, index: int | None) -> None:
        self.log.append(f"inflight {index}")


class _Done:
    def __init__(self, finished: bool) -> None:
        self.finished = finished

    def query(self) -> bool:
        return self.finished


def _worker(log: list[str], requested: list[int]) -> Any:
    """A DecodeWorker with only what `_between_pieces` touches: the step before in flight, the partitioner, the
    state block's inflight slot, the split to follow (`requested`, popped one per boundary)."""
    from types import SimpleNamespace

    from bullet_ray.engine.worker.roles.decode import DecodeWorker

    w = object.__new__(DecodeWorker)
    w.partitioner, w.res, w.runner = _Partitioner(), SimpleNamespace(state=_State(log)), SimpleNamespace(graph_key=0)
    w._moved_in_step, w._last_stream = False, None
    w.inflight = SimpleNamespace(done=_Done(False))

    def finish() -> None:  # inside the launch SideWorker.collect publishes nothing: the hook's entry stays
        log.append("collect")
        w.inflight = None

    def follow(target: int | None = None, site: str = "loop") -> None:
        assert site in ("piece", "sample")
        want = requested.pop(0)
        if want != w.partitioner.current_index:
            log.append(f"follow {want}" if site == "piece" else f"follow {want} at {site}")
            w.partitioner.current_index = want

    w._finish_inflight, w.follow_split, w._note_drain = finish, follow, lambda: log.append("drain?")
    return w


def test_the_worker_hook_follows_first_collects_once_the_step_before_finished_and_publishes_one_boundary_late():
    log: list[str] = []
    w = _worker(log, [0, 2, 2])
    assert w._between_pieces() == "stream0" and log == []  # the step before still runs: not waited for
    w.inflight.done.finished = True
    assert w._between_pieces() == "stream2" and w.runner.graph_key == 2
    # this step, the oldest still running, published on entry 0 where its pieces so far ran; then the move (its ack
    # does not wait for the collect's outputs); the collect keeps entry 0 published
    assert log == ["inflight 0", "follow 2", "collect"] and w._moved_in_step
    log.clear()
    assert w._between_pieces() == "stream2"  # the last piece on entry 0 has finished by this boundary
    assert log == ["inflight 2", "drain?"] and not w._moved_in_step and w._last_stream == "stream2"


def test_the_worker_looks_before_the_sampling_launch_only_at_a_split_not_followed_in_this_step():
    """`DecodeWorker._before_sample` (the runner calls it once a step's last piece is launched): with no split
    pending nothing is touched and the launch goes on where it is; with one pending it is followed as at a boundary
    between pieces (the switch record's site `sample`) and the sampling goes to the new partition's stream; after a
    move earlier in the step (the old entry's pieces not yet seen to finish) it waits for the step's end."""
    log: list[str] = []
    w = _worker(log, [2])
    w.switch_pending = lambda: False
    assert w._before_sample() is None and log == []
    w.switch_pending = lambda: True
    assert w._before_sample() == "stream2" and w.runner.graph_key == 2
    assert log == ["follow 2 at sample"] and w._moved_in_step and w._last_stream == "stream2"
    assert w._old_pieces_entry == 0  # its pieces ran on entry 0
    log.clear()
    assert w._before_sample() is None and log == []  # moved in this step: not again before the collect


def test_a_step_that_moved_with_no_later_boundary_is_published_on_its_old_pieces_entry():
    """After a move before the sampling launch (or at the last boundary between pieces), no later boundary sees the
    old entry's pieces finish: the step (the oldest in flight once the step before was collected) is published on the
    entry they ran on, once (`SideWorker.after_launch` asks `_runs_on_now`), so the other side judges the old entry
    drained only once the step has ended; a move that a later boundary saw finish leaves the entry where the side is."""
    from types import SimpleNamespace

    log: list[str] = []
    w = _worker(log, [2, 2, 2])
    w.prompts, w.inflight, w._next_record, w._selects_at_plan = [], None, ((1, 1), 0.01, False, 0), 0
    w.partitioner.selected_since = lambda n: [w.partitioner.current_index]
    w.switch = SimpleNamespace(overlap=True, is_settled=lambda: True, epoch=lambda: 0)
    w._other_runs_elsewhere = lambda step: False
    w.switch_pending = lambda: True
    w._before_sample()
    log.clear()
    w.after_launch(step := SimpleNamespace())
    assert step.runs_on == 0 and step.moved_while_launching and log == ["inflight 0"]
    assert w._old_pieces_entry is None
    w.partitioner.current_index, w._moved_in_step = 0, False
    w._between_pieces()  # a move at a boundary, then a later one that sees the old pieces finish
    w._between_pieces()
    log.clear()
    w.after_launch(step := SimpleNamespace())
    assert step.runs_on == 2 and log == ["inflight 2"]

def test_the_worker_cuts_a_wait_only_for_a_split_it_has_not_followed_and_not_right_after_a_move():
    """`DecodeWorker._move_pending`: a requested split not yet followed, unless the step moved at its last boundary
    (the next one must see the old entry's pieces finish before it publishes the new entry)."""
    log: list[str] = []
    w = _worker(log, [])
    w.switch_pending = lambda: True
    assert w._move_pending()
    w._moved_in_step = True
    assert not w._move_pending()
    w._moved_in_step, w.switch_pending = False, lambda: False
    assert not w._move_pending()


def test_the_longest_gap_between_looks_at_a_requested_split_is_kept(fake, monkeypatch):
    """A polled wait measures how long the host went between two looks at a requested split (here each event query
    takes 2 ms, as a held-up poll would): the step log's `piece_poll_gap_ms`. Reset at each step."""
    log, cuda = fake
    clock = [0.0]
    monkeypatch.setattr(cuda_graphs.time, "perf_counter", lambda: clock[0])
    real_event = cuda_graphs.torch.cuda.Event

    class SlowQuery(real_event):  # type: ignore[misc, valid-type]
        def query(self) -> bool:
            clock[0] += 0.002
            return super().query()

    monkeypatch.setattr(cuda_graphs.torch.cuda, "Event", SlowQuery)
    graphs, steps = _graphs(4, log)
    cuda.busy = {0: 3}  # piece 0 still runs for three queries when the host reaches piece 2
    graphs._run_pieces(0, 8, "plan", steps[0], lambda: (0, None), lambda: False)
    assert graphs.num_piece_waits_cut == 0 and graphs.last_poll_gap_s == pytest.approx(0.002)
    cuda.busy = {}
    graphs._run_pieces(0, 8, "plan", steps[0], lambda: (0, None), lambda: False)
    assert graphs.last_poll_gap_s == pytest.approx(0.002)  # one query, done at once: the wait's start to its end


def test_a_switch_back_acked_between_pieces_is_not_drained_while_this_steps_pieces_run_on_the_old_entry(tmp_path,
                                                                                                      monkeypatch):
    """A real state block: step N-1 ran on entry 1; decode moved to 2 at step N's launch and runs N's pieces there;
    a switch back to 1 that prefill acked first is acked by decode at the boundary where N-1 is collected. The
    drain must wait for N's pieces on entry 2 (found in review: with N-1's entry still published, the ack judged
    the drain done at once)."""
    import time
    from types import SimpleNamespace

    from bullet_ray.engine.gc_pauses import GcPauses
    from bullet_ray.engine.state_block import Policy, Side, StateBlock
    from bullet_ray.engine.worker.main import WorkerBase
    from bullet_ray.engine.worker.roles.decode import DecodeWorker
    from bullet_ray.gpu.partition import NonePartitioner, SplitSwitch

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        w = object.__new__(DecodeWorker)
        w.res, w.gc_pauses, w.partitioner = SimpleNamespace(state=block), GcPauses(), NonePartitioner("decode")
        w.switch = SplitSwitch(block.switch, w.partitioner.ladder, overlap=True)
        w.switch.reset(1)
        w.partitioner.select(1)
        drains: list[tuple] = []
        w.recorder = SimpleNamespace(log_switch=lambda *a, **k: None, log_drain=lambda *a: drains.append(a))
        w._launching, w._last_done_s, w._moved_in_step, w._last_stream = True, 0.0, False, None
        w.runner = SimpleNamespace(graph_key=1)
        block.set_inflight_index(Side.DECODE, 1)  # N-1 on entry 1, the oldest uncollected
        w.inflight = SimpleNamespace(perf_record=("shape", 0.01, False, 1), runs_on=1,
                                     done=SimpleNamespace(query=lambda: True))

        def request(index: int) -> None:
            assert w.switch.request(index)
            block.policy[Policy.PENDING_SWITCH_US] = time.monotonic_ns() // 1000

        def finish() -> None:
            step, w.inflight = w.inflight, None
            w.collect(step)  # SideWorker.collect: the published entry, the drain check

        monkeypatch.setattr(WorkerBase, "collect", lambda self, step: "result")  # no runner
        w._finish_inflight = finish
        request(2)
        w.follow_split(site="launch")  # decode moves first at N's launch; prefill follows
        w.switch.slots[1] = 2  # PREFILL_ACK
        block.record_switch_done()
        request(1)  # back, while N's pieces run on entry 2; prefill (nothing in flight) acks first
        w.switch.slots[1] = 1
        w._between_pieces()
        assert w.partitioner.current_index == 1 and w._moved_in_step
        assert drains == [] and block.inflight_index(Side.DECODE) == 2  # N's pieces still run on entry 2
        w._between_pieces()  # the next boundary: N's last piece on entry 2 has finished
        assert block.inflight_index(Side.DECODE) == 1 and [d[1] for d in drains] == [1]
    finally:
        block.close()


def test_run_records_the_host_time_before_the_first_replay_and_the_plans_part(monkeypatch):
    """`DecodeGraphs.run` keeps the host's time from its start to the step's first replay (`last_setup_s`: inputs
    copied, page tables staged, plan, graph looked up) and the plan's part of it (`last_plan_s`): the step log's
    graph_setup_ms / graph_plan_ms, where a plan that blocks would show, and its waits for the GPU (graph_wait_ms)."""
    clock = [0.0]
    monkeypatch.setattr(cuda_graphs.time, "perf_counter", lambda: clock[0])
    log: list[str] = []
    graphs, steps = _graphs(1, log)
    graphs.input_ids, graphs.positions, graphs.slots = (torch.zeros(8, dtype=torch.long) for _ in range(3))
    graphs.scratch_slot, graphs.bucket = None, lambda n: 8

    def plan(b, tables, lens):
        clock[0] += 0.002  # a plan that held the host 2 ms, 1.2 of them waiting for the GPU (a fence, a staging slot)
        graphs._wait_s += 0.0012
        return "plan"

    def copy_(*args, **kwargs):  # the inputs' copies take 0.5 ms
        clock[0] += 0.0005

    graphs._plan = plan
    metadata = SimpleNamespace(slot_mapping=torch.zeros(2, dtype=torch.long), seq_lens_list=[3, 4])
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, *a, **k: copy_())
    out = graphs.run(0, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), metadata, [[1], [2]])
    assert out.shape[0] == 2 and log == ["replay p0.0"]
    assert graphs.last_plan_s == pytest.approx(0.002) and graphs.last_setup_s == pytest.approx(0.002 + 6 * 0.0005)
    assert graphs.last_wait_s == pytest.approx(0.0012)  # the step log's graph_wait_ms
    graphs.run(0, torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), metadata, [[1], [2]])
    assert graphs.last_wait_s == pytest.approx(0.0012)  # counted from each run's start, not summed over runs
