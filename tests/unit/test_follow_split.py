"""A worker's `follow_split` at its step boundary, on fakes: in disjoint mode a side collects its step in flight
before it acks a new split (the SMs it gives up are free when it says so) and a side that grows waits for the
other's ack; in overlap mode both ack at once and a step in flight keeps running on the old partition, recorded
and published against the entry it ran on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bullet_ray.engine.gc_pauses import GcPauses
from bullet_ray.engine.worker.main import WorkerBase
from bullet_ray.engine.worker.step_profile import StepProfiler
from bullet_ray.gpu.partition import NonePartitioner, SplitSwitch


class _Side(WorkerBase):
    """Only what `follow_split` touches: a partitioner, the switch over shared slots, a step in flight."""

    def __init__(self, side: str, slots: np.ndarray, overlap: bool) -> None:  # no engine resources
        self.partitioner = NonePartitioner(side)
        self.partitioner.select(1)
        self.switch = SplitSwitch(slots, self.partitioner.ladder, overlap=overlap)
        self.inflight = SimpleNamespace(ladder_index=1)
        self.collected: list[int] = []

    def _finish_inflight(self) -> None:
        self.collected.append(self.inflight.ladder_index)
        self.inflight = None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_side_collects_its_step_before_it_moves_only_when_disjoint(overlap: bool):
    slots = np.zeros(4, dtype=np.int64)
    decode, prefill = _Side("decode", slots, overlap), _Side("prefill", slots, overlap)
    decode.switch.reset(1)
    top = len(decode.partitioner.ladder) - 1
    assert decode.switch.request(top)  # decode grows, prefill shrinks
    decode.follow_split()
    # disjoint: decode collects its step, then waits for prefill's SMs; overlap: it moves, its step still running
    assert decode.partitioner.current_index == (top if overlap else 1)
    assert decode.collected == ([] if overlap else [1])
    prefill.follow_split()
    assert prefill.partitioner.current_index == top
    if overlap:  # the shrinking side acked with its step still running on the old partition
        assert prefill.collected == [] and prefill.inflight is not None
    else:  # the shrinking side collected its step first, then acked
        assert prefill.collected == [1] and prefill.inflight is None
        decode.follow_split()
        assert decode.partitioner.current_index == top and decode.inflight is None
    assert decode.switch.is_settled()


def test_a_step_is_recorded_against_the_entry_it_ran_on_and_not_learned_across_a_switch(tmp_path):
    """A step planned and launched on entry 1 is logged, ringed and published as entry 1's after its side moved
    to entry 0; one that ran on a single entry teaches the model, one across a switch does not (ring index -1)."""
    from bullet_ray.engine.state_block import Field, Side, StateBlock
    from bullet_ray.engine.worker.policy_link import StepRecorder
    from bullet_ray.perf.kernels import StepShape

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        observed: list[tuple[int, int]] = []
        model = SimpleNamespace(observe=lambda shape, sms, busy, index, s: observed.append((sms, index)))
        partitioner = NonePartitioner("decode")
        worker = SimpleNamespace(res=SimpleNamespace(state=block), side=Side.DECODE, partitioner=partitioner,
                                 config=SimpleNamespace(step_log_path=None))
        recorder = StepRecorder(worker, model)  # type: ignore[arg-type]
        partitioner.select(0)  # the side moved on since the launch on entry 1
        for across in (False, True):
            recorder.record(StepShape.decode(4, 400), 0.010, False, 1, 0.0, 0, 0, True, gpu_time_s=0.012,
                            across_switch=across)
            recorder.enter_ring()
            block.publish(Side.DECODE, num_seqs=4, num_tokens=4, num_context_tokens=400, step_time_us=12_000,
                          num_queued=0, split_index=1)
        assert observed == [(partitioner.ladder[1].decode_sms, 1)]  # the first step only
        _, entries = block.recent_steps(Side.DECODE, 0)
        assert entries == [(12_000, 10_000, 1), (12_000, 10_000, -1)]
        assert block.rows[int(Side.DECODE)][Field.SPLIT_INDEX] == 1
    finally:
        block.close()


@pytest.mark.parametrize("launched_on,now,unsettled,beside,epochs,overlap,across", [
    (1, 1, False, (False, False), (3, 3), True, False), (1, 0, False, (False, False), (3, 3), True, True),
    (1, 1, True, (False, False), (3, 3), True, True), (1, 1, False, (True, False), (3, 3), True, True),
    (1, 1, False, (False, True), (3, 3), True, True), (1, 1, False, (False, False), (3, 4), True, True),
    (1, 1, False, (False, False), (3, 4), False, False), (1, 1, "moved", (False, False), (3, 3), False, True)])
def test_publish_step_flags_a_step_across_a_switch(launched_on, now, unsettled, beside, epochs, overlap, across):
    """Across: the side moved since the launch, or launched before the switch settled, or the other side had a
    step in flight on another entry sharing its SMs at the launch (beside[0]) or at the collect (beside[1]), or,
    in overlap mode, a switch was requested while it ran (epochs: at launch, at collect; in disjoint mode a side
    finishes its step before it moves, so a request meanwhile leaves the step clean), or ("moved") a layer-wise
    step moved between its groups while it launched, even back to the entry it was planned on."""
    from bullet_ray.engine.worker.roles import SideWorker

    calls: dict[str, tuple] = {}
    fake = SimpleNamespace(
        partitioner=SimpleNamespace(current_index=now), has_work=lambda: True,
        recorder=SimpleNamespace(record=lambda *a, **k: calls.update(record=(a, k)),
                                 enter_ring=lambda: None),
        publish=lambda *a: calls.update(publish=a), _other_runs_elsewhere=lambda step: beside[1],
        switch=SimpleNamespace(overlap=overlap, epoch=lambda: epochs[1]), gc_pauses=GcPauses())
    step = SimpleNamespace(perf_record=("shape", 0.01, False, launched_on), launched_unsettled=unsettled is True,
                           moved_while_launching=unsettled == "moved",
                           beside_other_entry=beside[0], launch_epoch=epochs[0], num_layer_groups=1, gpu_time_s=0.01,
                           log_fields=lambda: {}, graphs=None, batch=[1, 2])
    result = SimpleNamespace(num_tokens=2, num_context_tokens=20)
    SideWorker.publish_step(fake, step, 0.0, result, 0, 0)  # type: ignore[arg-type]
    args, kwargs = calls["record"]
    assert args[3] == launched_on and kwargs["across_switch"] is across
    assert calls["publish"][-1] == launched_on  # the row names the entry the step ran on


def _recording_side(side, block):
    """A SideWorker with only what `after_launch` and `collect` touch: the state block, a switch, a step in
    flight (`WorkerBase.collect` stubbed to return the step)."""
    from bullet_ray.engine.worker.main import WorkerBase
    from bullet_ray.engine.worker.roles import SideWorker

    switch = SplitSwitch(np.zeros(4, dtype=np.int64), NonePartitioner("decode").ladder, overlap=True)

    class RecordingSide(SideWorker):
        def __init__(self) -> None:  # no engine resources
            self.res = SimpleNamespace(state=block)
            self.side = side
            self.switch = SimpleNamespace(overlap=True, is_settled=lambda: True, epoch=switch.epoch,
                                          shares_sms=switch.shares_sms)
            self.partitioner = NonePartitioner(side.name.lower())
            self.inflight = None
            self._next_record = None
            self._selects_at_plan = 0
            self._launching = False

    worker = RecordingSide()
    worker.launch_on = lambda index, groups=1: _launched(worker, index, groups)
    return worker, WorkerBase


def _launched(worker, index, num_layer_groups=1):
    """What `WorkerBase.step` does around a launch: predict, launch, `after_launch`, then the new step is in
    flight (the previous one, if any, still uncollected). A one-group step launches where it was planned; a
    layer-wise one's last groups where the side is by then."""
    worker._next_record = ("shape", 0.01, True, index)
    if num_layer_groups == 1:
        worker.partitioner.select(index)
    step = SimpleNamespace(perf_record=None, num_layer_groups=num_layer_groups)
    worker.after_launch(step)
    return step


def test_a_step_beside_the_other_sides_step_on_another_entry_is_flagged(tmp_path, monkeypatch):
    """Overlap mode, decode grows from entry 1 to 2 while prefill's last step on entry 1 still runs: decode's
    first step on entry 2 shares SMs with it and is flagged; once prefill collected that step, decode's next step
    on entry 2 is clean. Each side publishes the entry of its oldest uncollected step, and clears it."""
    from bullet_ray.engine.state_block import Side, StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        prefill, base = _recording_side(Side.PREFILL, block)
        decode, _ = _recording_side(Side.DECODE, block)
        monkeypatch.setattr(base, "collect", lambda self, step: "result")
        old = prefill.launch_on(1)  # prefill's step on the old entry, in flight
        prefill.inflight = old
        assert block.inflight_index(Side.PREFILL) == 1
        first = decode.launch_on(2)  # decode moved to entry 2 (overlap: it did not wait)
        assert first.beside_other_entry and decode._other_runs_elsewhere(first)
        decode.inflight = first
        assert block.inflight_index(Side.DECODE) == 2
        prefill.inflight = None
        assert prefill.collect(old) == "result" and block.inflight_index(Side.PREFILL) is None
        assert not decode._other_runs_elsewhere(first)  # at its collect prefill runs nothing: flagged at launch
        second = decode.launch_on(2)
        assert not second.beside_other_entry
        assert block.inflight_index(Side.DECODE) == 2  # `first` is still the oldest uncollected
        decode.inflight = second
        decode.collect(first)  # the worker swapped `second` in before collecting `first`
        assert block.inflight_index(Side.DECODE) == 2
        decode.inflight = None
        decode.collect(second)
        assert block.inflight_index(Side.DECODE) is None
        # the side that shrinks moving first shares no SMs: prefill on entry 2 (100 SMs) beside decode's step on
        # entry 1 (24 SMs) is clean, decode on entry 2 (32) beside prefill's step on entry 1 (108) is not
        decode.inflight = decode.launch_on(1)
        assert not prefill.launch_on(2).beside_other_entry
        # a layer-wise step planned on entry 2 whose side moved to 3 between its groups: it runs on 3 now
        prefill.partitioner.current_index = 3
        prefill.launch_on(2, groups=4)
        assert block.inflight_index(Side.PREFILL) == 3
    finally:
        block.close()


def test_the_oldest_step_is_published_where_it_runs_not_where_its_side_moved_since(tmp_path, monkeypatch):
    """Overlap mode: a layer-wise step's last groups launched on entry 1, then its side moved to 2 and launched the
    next step ahead there; until the layer-wise step is collected the row names entry 1 (the other side's records
    and the switch's drain read it)."""
    from bullet_ray.engine.state_block import Side, StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        prefill, base = _recording_side(Side.PREFILL, block)
        monkeypatch.setattr(base, "collect", lambda self, step: "result")
        prefill.partitioner.select(1)
        layerwise = prefill.launch_on(1, groups=4)
        prefill.inflight = layerwise
        ahead = prefill.launch_on(2)  # the side moved at its next plan; the step launched ahead runs on 2
        assert block.inflight_index(Side.PREFILL) == 1
        prefill.inflight = ahead
        prefill.collect(layerwise)
        assert block.inflight_index(Side.PREFILL) == 2
    finally:
        block.close()


def test_a_switch_drains_when_the_last_step_on_the_old_entry_is_collected(tmp_path, monkeypatch):
    """Both sides acked a switch to entry 2 while decode's step launched ahead on entry 1 still runs: the drain
    is logged when decode collects it (after publishing its next step, on entry 2), not before, and once."""
    from bullet_ray.engine.state_block import Side, StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        decode, base = _recording_side(Side.DECODE, block)
        monkeypatch.setattr(base, "collect", lambda self, step: "result")
        drains: list[tuple[int, int]] = []
        decode.recorder = SimpleNamespace(log_drain=lambda us, index: drains.append((us, index)))
        old = decode.launch_on(1)
        decode.inflight = old
        block.record_decision(2, 0, 0, 0, is_switch=True)
        block.switch[:3] = 2  # requested and acked by both
        assert block.record_switch_done() is not None
        ahead = decode.launch_on(2)  # its next launch is on entry 2; `old` still runs on 1
        decode._note_drain()
        assert drains == []
        decode.inflight = ahead
        decode.collect(old)
        assert len(drains) == 1 and drains[0][1] == 2 and drains[0][0] >= 0
        decode.inflight = None
        decode.collect(ahead)
        assert len(drains) == 1 and block.read_policy()["num_drains"] == 1
    finally:
        block.close()


class _Stream:
    def __init__(self, name: str) -> None:
        self.name, self.waited_on = name, []

    def wait_event(self, event) -> None:
        self.waited_on.append(event)


class _Launcher(WorkerBase):
    """`WorkerBase.launch` over a partitioner whose entries have distinct streams (green contexts' stand-ins)."""

    def __init__(self) -> None:  # no engine resources
        self.streams = [_Stream("entry0"), _Stream("entry1")]
        self.partitioner = SimpleNamespace(side="decode", current_index=1,
                                           current_stream=lambda side: self.streams[self.partitioner.current_index])
        self.runner = SimpleNamespace(graph_key=None, launch=lambda *a: SimpleNamespace(sampled=[]))
        self.allocator = SimpleNamespace(on_launch=lambda: None)
        self.profiler = StepProfiler(None, 0, 0, "decode", is_gpu=False)
        self.awaiting: dict = {}
        self.inflight = None
        self._last_stream = None


@pytest.mark.parametrize("moved,in_flight,waits", [(True, True, True), (True, False, False), (False, True, False)])
def test_a_step_on_a_new_partition_waits_for_the_step_still_in_flight(monkeypatch, moved, in_flight, waits):
    """After a switch with a step in flight (overlap mode), the next step's stream waits on that step's end
    event: it reads the step's sampled ids and KV; with no step in flight, or on the same stream, it does not."""
    import contextlib

    import bullet_ray.engine.worker.main as main

    monkeypatch.setattr(main.torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    worker = _Launcher()
    worker.launch([])  # the first step, on entry 1
    done = object()
    worker.inflight = SimpleNamespace(done=done) if in_flight else None
    if moved:
        worker.partitioner.current_index = 0
    worker.launch([])
    new = worker.streams[worker.partitioner.current_index]
    assert new.waited_on == ([done] if waits else []) and worker._last_stream is new
    assert worker.runner.graph_key == worker.partitioner.current_index  # graphs of the partition it runs on


def test_split_switch_setting_is_checked_and_passed_through():
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    assert EngineConfig().split_switch == "overlap"  # the default since the H100 A/B (serve_h100_m2v)
    assert EngineArgs().to_engine_config().split_switch == "overlap"
    assert EngineArgs(split_switch="disjoint").to_engine_config().split_switch == "disjoint"
    with pytest.raises(ConfigError, match="split_switch.*'sideways'"):
        EngineConfig(split_switch="sideways")
    with pytest.raises(ValueError, match="split_switch"):
        EngineArgs(split_switch="sideways")


@pytest.mark.parametrize("requested,follows", [(0, True), (1, False)])
def test_a_layer_wise_prefill_does_not_move_onto_an_entry_without_prefill_sms(requested, follows):
    """Between layer groups the prefill side follows a new split, except onto the mixed fallback's whole-GPU
    entry (no prefill SMs, no prefill stream): its step finishes on its SMs first."""
    from bullet_ray.engine.state_block import Side
    from bullet_ray.engine.worker.roles import PrefillWorker
    from bullet_ray.gpu.partition import LadderEntry

    followed: list[bool] = []
    published: list[int | None] = []
    fake = SimpleNamespace(decider=None, switch=SimpleNamespace(requested=lambda: requested), side=Side.PREFILL,
                           partitioner=SimpleNamespace(ladder=[LadderEntry(0, 64, 68), LadderEntry(1, 132, 0)],
                                                       side="prefill", current_stream=lambda side: "stream",
                                                       current_index=0),
                           follow_split=lambda target, site: followed.append(target == requested and site == "group"),
                           _note_drain=lambda: None,
                           res=SimpleNamespace(state=SimpleNamespace(
                               set_inflight_index=lambda side, index: published.append(index))))
    assert PrefillWorker._between_layer_groups(fake) == "stream"  # type: ignore[arg-type]
    assert followed == ([True] if follows else [])  # follows the entry it checked, not a later read
    assert published == ([0] if follows else [])  # where the next groups run, for the other side's step records


def test_a_layer_wise_step_that_moved_between_its_groups_and_back_is_flagged(tmp_path):
    """Planned on entry 1, its groups moved to 2 and back to 1 while it launched: it ran on two entries though it
    ends where it began; a step whose side did not move meanwhile is clean."""
    from bullet_ray.engine.state_block import Side, StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        prefill, _ = _recording_side(Side.PREFILL, block)
        for index in (0, 2, 1):  # earlier moves, before this step was planned
            prefill.partitioner.select(index)
        prefill._selects_at_plan = prefill.partitioner.num_selects
        for index in (2, 1):  # between its layer groups
            prefill.partitioner.select(index)
        assert _launched(prefill, 1, num_layer_groups=4).moved_while_launching
        prefill._selects_at_plan = prefill.partitioner.num_selects
        prefill.partitioner.select(1)  # its groups stayed on entry 1
        assert not _launched(prefill, 1, num_layer_groups=4).moved_while_launching
    finally:
        block.close()


@pytest.mark.parametrize("requested,overlap,in_flight,prompt,follows", [
    (None, True, False, False, False), (1, True, False, False, False),  # nothing new requested
    (0, True, False, False, True), (0, True, True, False, True),  # overlap: the step in flight keeps running
    (0, False, False, False, True),  # disjoint, nothing in flight: nothing to collect
    (0, False, True, False, False),  # disjoint with a step in flight: following would collect it (the loop does)
    (0, True, False, True, False),  # a step with a prompt chunk (mixed fallback): planned for its entry's graphs
])
def test_decode_follows_a_split_requested_while_it_planned_before_it_launches(monkeypatch, requested, overlap,
                                                                             in_flight, prompt, follows):
    """A split requested after the loop's follow (while the decode side planned) is followed at the launch of a
    decode-only step, and the step is predicted again on the new entry, unless following would collect the step
    in flight (disjoint mode): that collect could finish sequences the planned batch holds."""
    from bullet_ray.engine.worker.roles import DecodeWorker

    slots = np.zeros(4, dtype=np.int64)
    worker = DecodeWorker.__new__(DecodeWorker)  # only what the launch's follow reads
    worker.gc_pauses = GcPauses()
    worker.partitioner = NonePartitioner("decode")
    worker.partitioner.select(1)
    worker.switch = SplitSwitch(slots, worker.partitioner.ladder, overlap=overlap)
    worker.switch.reset(1)
    worker.inflight = SimpleNamespace(ladder_index=1) if in_flight else None
    worker._last_done_s, worker._launching = 0.0, False
    worker._finish_inflight = lambda: pytest.fail("collected between plan and launch")  # type: ignore[method-assign]
    worker.config = SimpleNamespace(decode_pieces=1, uses_split_policy=True, is_gpu=False)
    worker.res = SimpleNamespace(state=SimpleNamespace(record_switch_done=lambda: None))
    predicted: list[int] = []
    worker.predicted = lambda batch: predicted.append(worker.partitioner.current_index) or batch  # type: ignore[method-assign]
    launched: list[int] = []
    monkeypatch.setattr(WorkerBase, "launch", lambda self, batch, *rest: launched.append(self.partitioner.current_index))
    if requested is not None:
        worker.switch.request(requested)
    batch = [SimpleNamespace(num_new_tokens=1), SimpleNamespace(num_new_tokens=7 if prompt else 1)]
    worker.launch(batch)
    assert launched == [requested if follows else 1]
    assert predicted == ([requested] if follows else [])
    assert worker.switch_pending() == (requested == 0 and not follows)


@pytest.mark.parametrize("requested,overlap,in_flight,follows", [
    (0, True, True, True),     # requested while the step's inputs were prepared: followed before its forward
    (1, True, True, False),    # nothing requested: the step stays where it was
    (0, False, True, False),   # disjoint with a step in flight: following would collect it mid-launch
    (0, False, False, True),   # disjoint, nothing in flight: followed
])
def test_a_decode_step_in_pieces_follows_a_split_requested_while_its_inputs_were_prepared(requested, overlap,
                                                                                          in_flight, follows):
    """`DecodeWorker._before_pieces` (ModelRunner.forward calls it once the inputs are prepared, before any of the
    forward): a split requested since the look at launch is followed there, as at launch, the step predicted again
    on the new entry, the runner's graph key and the stream it goes on returned; else nothing moves (None)."""
    from bullet_ray.engine.worker.roles import DecodeWorker

    slots = np.zeros(4, dtype=np.int64)
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.gc_pauses = GcPauses()
    worker.partitioner = NonePartitioner("decode")
    worker.partitioner.select(1)
    worker.partitioner.current_stream = lambda side: f"stream{worker.partitioner.current_index}"  # type: ignore[method-assign]
    worker.switch = SplitSwitch(slots, worker.partitioner.ladder, overlap=overlap)
    worker.switch.reset(1)
    worker.inflight = SimpleNamespace(ladder_index=1) if in_flight else None
    worker._last_done_s, worker._launching, worker._last_stream = 0.0, True, "stream1"
    worker._launch_began_s = worker._launch_ended_s = 0.0
    worker._finish_inflight = lambda: pytest.fail("collected inside the launch")  # type: ignore[method-assign]
    worker.res = SimpleNamespace(state=SimpleNamespace(record_switch_done=lambda: None))
    worker.runner = SimpleNamespace(graph_key=1)
    batch = [SimpleNamespace(num_new_tokens=1)]
    predicted: list[tuple[int, object]] = []
    worker.predicted = lambda b: predicted.append((worker.partitioner.current_index, b)) or b  # type: ignore[method-assign]
    worker.switch.request(requested)
    stream = worker._before_pieces(batch)  # type: ignore[arg-type]
    if follows:
        assert stream == "stream0" and worker.runner.graph_key == 0 and worker._last_stream == "stream0"
        assert predicted == [(0, batch)] and not worker.switch_pending()
    else:
        assert stream is None and worker.runner.graph_key == 1 and predicted == []
        assert worker.partitioner.current_index == 1


@pytest.mark.parametrize("in_flight,last_done,launching", [(True, 5.0, True), (False, 0.0, False)])
def test_the_side_that_completes_a_switch_logs_where_it_acked(monkeypatch, in_flight, last_done, launching):
    """The switch record names the boundary that completed the switch (here a decode step's launch), whether that
    side had an earlier step in flight, whether it was inside a launch, and the time since its last collect (None
    when idle since)."""
    from bullet_ray.engine.worker.roles import DecodeWorker

    slots = np.zeros(4, dtype=np.int64)
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.gc_pauses = GcPauses()
    worker.partitioner = NonePartitioner("decode")
    worker.partitioner.select(1)
    worker.switch = SplitSwitch(slots, worker.partitioner.ladder, overlap=True)
    worker.switch.reset(1)
    worker.inflight = SimpleNamespace(ladder_index=1) if in_flight else None
    worker._last_done_s, worker._launching = last_done, launching
    worker._launch_began_s, worker._launch_ended_s = 5.001, 4.9  # this side's last launch began, the one before ended
    worker.config = SimpleNamespace(decode_pieces=1, uses_split_policy=True, is_gpu=False)
    worker.res = SimpleNamespace(state=SimpleNamespace(record_switch_done=lambda: 1234,
                                                       record_drain_if_done=lambda: None))
    logged: list[tuple] = []
    worker.recorder = SimpleNamespace(log_switch=lambda us, index, **where: logged.append((us, index, where)))
    worker.predicted = lambda batch: batch  # type: ignore[method-assign]
    monkeypatch.setattr(WorkerBase, "launch", lambda self, batch, *rest: None)
    monkeypatch.setattr("time.perf_counter", lambda: 5.0025)
    worker.switch.request(0)
    worker.launch([SimpleNamespace(num_new_tokens=1)])
    assert len(logged) == 1
    us, index, where = logged[0]
    assert (us, index, where["site"], where["inflight"], where["launching"]) == (1234, 0, "launch", in_flight, launching)
    assert where["since_collect_ms"] == (2.5 if last_done else None)
    # the decision (1234 us before the ack at 5.0025) against the side's launches: 0.266 ms after the last one began
    assert (where["launch_began_ms"], where["launch_ended_ms"]) == (0.266, 101.266)


def test_a_disjoint_switch_logs_where_the_side_was_before_it_collected(monkeypatch):
    """In disjoint mode following collects the step in flight first: the record still says a step was in flight and
    counts the time since the collect before it (not the follow's own)."""
    from bullet_ray.engine.worker.roles import DecodeWorker

    slots = np.zeros(4, dtype=np.int64)
    worker = DecodeWorker.__new__(DecodeWorker)
    worker.gc_pauses = GcPauses()
    worker.partitioner = NonePartitioner("decode")
    top = len(worker.partitioner.ladder) - 1
    worker.partitioner.select(top)
    worker.switch = SplitSwitch(slots, worker.partitioner.ladder, overlap=False)
    worker.switch.reset(top)
    worker.inflight, worker._last_done_s, worker._launching = SimpleNamespace(ladder_index=top), 5.0, False

    def finish() -> None:  # the collect: nothing in flight since, the last collect now
        worker.inflight, worker._last_done_s = None, 5.004

    worker._finish_inflight = finish  # type: ignore[method-assign]
    worker.res = SimpleNamespace(state=SimpleNamespace(record_switch_done=lambda: 1234,
                                                       record_drain_if_done=lambda: None))
    logged: list[dict] = []
    worker.recorder = SimpleNamespace(log_switch=lambda us, index, **where: logged.append(where))
    monkeypatch.setattr("time.perf_counter", lambda: 5.0045)
    assert worker.switch.request(0)  # decode shrinks: it collects its step, then acks
    worker.follow_split()
    assert worker.partitioner.current_index == 0 and worker.inflight is None
    assert logged == [{"site": "loop", "inflight": True, "launching": False, "since_collect_ms": 4.5, "gc_ms": 0.0,
                       "launch_began_ms": None, "launch_ended_ms": None}]  # no launch yet
