"""SM-partition backends without a GPU (none, mps, auto), typed errors for bad arguments, and the split-switch
protocol (shrinking side first; partitions never overlap) with threads and with two processes."""

from __future__ import annotations

import multiprocessing as mp
import random
import threading
from multiprocessing import shared_memory

import numpy as np
import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.gpu import smctl
from bullet_ray.gpu.partition import (
    BACKENDS,
    DECODE_ACK,
    EPOCH,
    PREFILL_ACK,
    REQUESTED,
    LadderEntry,
    MpsPartitioner,
    NonePartitioner,
    SplitSwitch,
    default_ladder,
    make_partitioner,
)

NO_GPU = not smctl.capability_report(0).has_gpu


def test_default_ladder():
    assert default_ladder(132) == list(range(16, 113, 8))  # 16, 24, ..., 112 on an H100
    assert default_ladder(132, 16) == [16, 32, 48, 64, 80, 96, 112]
    assert default_ladder(20) == [10]
    with pytest.raises(ConfigError, match="sm_count"):
        default_ladder(1)


def test_none_backend_records_choices_and_has_no_streams():
    p = make_partitioner("none", "both", decode_sm_counts=[16, 64, 112], sm_count=132)
    assert p.name == "none" and not p.is_switchable
    assert p.ladder == [LadderEntry(0, 16, 116), LadderEntry(1, 64, 68), LadderEntry(2, 112, 20)]
    assert p.select(2) is False and p.select(0) is False  # no hardware effect
    assert p.current_index == 0 and p.num_selects == 2 and p.selected_since(0) == {0, 2}
    assert p.current == p.ladder[0]
    assert p.stream(1, "decode") is None and p.current_stream("prefill") is None
    assert p.capabilities.sm_count == 132 and not p.capabilities.green_ctx_supported


def test_a_million_selects_keep_the_partitioner_bounded():
    """A long serving run selects at every step boundary: what the partitioner keeps grows with its ladder, not
    with the number of selects."""
    p = make_partitioner("none", "prefill", decode_sm_counts=[16, 64, 112], sm_count=132)
    for k in range(1_000_000):
        p.select(k % 3)
    assert p.num_selects == 1_000_000
    sized = {name: len(value) for name, value in vars(p).items() if isinstance(value, (list, dict, set, tuple))}
    assert sized and all(size <= len(p.ladder) for size in sized.values()), sized


def test_selected_since_answers_what_the_full_history_answered():
    """`selected_since(mark)` against the list of every select it replaces: for every mark and planned entry, the
    layer-wise prefill's check (did the side run on another entry since it planned?) decides the same."""
    import random

    rng = random.Random(7)
    p = make_partitioner("none", "prefill", decode_sm_counts=[16, 40, 64, 88, 112], sm_count=132)
    history: list[int] = []
    for _ in range(300):
        index = rng.randrange(len(p.ladder)) if rng.random() < 0.3 else p.current_index  # mostly stays put
        p.select(index)
        history.append(index)
        for mark in range(max(0, len(history) - 12), len(history) + 1):
            assert p.selected_since(mark) == set(history[mark:])
            for planned in range(len(p.ladder)):
                assert any(i != planned for i in p.selected_since(mark)) == any(i != planned for i in history[mark:])


def test_none_backend_default_ladder():
    p = NonePartitioner("decode")
    assert [e.decode_sms for e in p.ladder] == default_ladder(132)


@pytest.mark.skipif(not NO_GPU, reason="this machine has a GPU")
def test_auto_falls_back_to_none_without_a_driver():
    p = make_partitioner("auto", "decode")
    assert p.name == "none" and "driver" in p.capabilities.reason.lower()
    with pytest.raises(smctl.NotSupportedError, match="green contexts unavailable"):
        make_partitioner("green", "decode")


def test_mps_backend_is_one_fixed_entry():
    p = MpsPartitioner("decode", 132, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25"})
    assert p.ladder == [LadderEntry(0, 33, 99)]
    q = MpsPartitioner("prefill", 132, env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "75"})
    assert q.ladder == [LadderEntry(0, 33, 99)]
    assert p.select(0) is False and p.stream(0, "decode") is None
    with pytest.raises(ConfigError, match="split_index"):
        p.select(1)
    assert MpsPartitioner("decode", 132, env={}).ladder == [LadderEntry(0, 132, 0)]  # unset: 100%


@pytest.mark.parametrize("env,match", [({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "x"}, "'x' is not a number"),
                                       ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "0"}, "outside")])
def test_mps_backend_bad_percentage(env, match):
    with pytest.raises(ConfigError, match=match):
        MpsPartitioner("decode", 132, env=env)


@pytest.mark.parametrize("kwargs,field,value", [
    ({"backend": "warp-drive", "side": "decode"}, "partition", "warp-drive"),
    ({"backend": "none", "side": "middle"}, "side", "middle"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [0]}, "decode_sm_counts", "0"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [200]}, "decode_sm_counts", "200"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [132]}, "decode_sm_counts", "132"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": []}, "decode_sm_counts", "empty"),
    ({"backend": "none", "side": "decode", "decode_sm_counts": [16.5]}, "decode_sm_counts", "16.5"),
    ({"backend": "mps", "side": "both", "sm_count": 132}, "side", "per process"),
])
def test_bad_partition_arguments_are_typed_errors_naming_the_value(kwargs, field, value):
    with pytest.raises(ConfigError) as err:
        make_partitioner(**kwargs)
    assert err.value.field == field and value in str(err.value)
    if field == "partition":
        assert all(name in str(err.value) for name in BACKENDS)


def test_select_and_stream_bad_arguments():
    p = NonePartitioner("decode", 132, [16, 32])
    with pytest.raises(ConfigError, match="index 5 outside"):
        p.select(5)
    with pytest.raises(ConfigError, match="index -1"):
        p.stream(-1, "decode")
    with pytest.raises(ConfigError, match="'decode' side only"):
        p.stream(0, "prefill")
    with pytest.raises(ConfigError, match="unknown side 'left'"):
        p.stream(0, "left")


LADDER = [LadderEntry(0, 16, 116), LadderEntry(1, 64, 68), LadderEntry(2, 112, 20)]


def _switch(index: int = 1) -> SplitSwitch:
    sw = SplitSwitch(np.zeros(4, dtype=np.int64), LADDER)
    sw.reset(index)
    return sw


def test_switch_shrinking_side_first_then_the_growing_side():
    sw = _switch(1)
    assert sw.request(2)  # decode grows 64 -> 112, prefill shrinks 68 -> 20
    assert sw.slots[EPOCH] == 1 and not sw.is_settled()
    assert sw.maybe_switch("decode") is None  # must wait for prefill to release SMs
    assert sw.maybe_switch("prefill") == 2
    assert sw.maybe_switch("prefill") is None  # already there
    assert sw.maybe_switch("decode") == 2 and sw.is_settled()
    assert sw.request(0)  # now decode shrinks
    assert sw.maybe_switch("prefill") is None
    assert sw.maybe_switch("decode") == 0
    assert sw.maybe_switch("prefill") == 0
    assert list(sw.slots) == [0, 0, 0, 2]


def test_whole_gpu_entry_for_the_mixed_fallback():
    """The mixed fallback's entry past the ladder's last: decode every SM, prefill none. Moving there, prefill
    gives up its SMs first and decode takes the whole GPU only after; moving back, decode gives them up first."""
    p = make_partitioner("none", "decode", decode_sm_counts=[16, 64, 112], sm_count=132)
    assert p.whole_index is None
    assert p.add_whole_gpu_entry() == 3 and p.add_whole_gpu_entry() == 3  # once
    assert p.ladder[3] == LadderEntry(3, 132, 0) and p.stream(3, "decode") is None
    sw = SplitSwitch(np.zeros(4, dtype=np.int64), p.ladder)
    sw.reset(2)
    assert sw.request(3)
    assert sw.maybe_switch("decode") is None  # prefill still holds its 20 SMs
    assert sw.maybe_switch("prefill") == 3 and sw.maybe_switch("decode") == 3 and sw.is_settled()
    assert sw.request(1)
    assert sw.maybe_switch("prefill") is None  # decode still holds every SM
    assert sw.maybe_switch("decode") == 1 and sw.maybe_switch("prefill") == 1


def test_request_waits_for_the_previous_switch_to_settle():
    sw = _switch(1)
    assert sw.request(2)
    assert not sw.request(0)  # prefill has not moved yet: nothing written
    assert sw.slots[REQUESTED] == 2 and sw.slots[EPOCH] == 1
    sw.maybe_switch("prefill")
    sw.maybe_switch("decode")
    assert sw.request(0) and sw.slots[EPOCH] == 2
    assert sw.request(0) and sw.slots[EPOCH] == 2  # asking for where a pending request goes: no new epoch


def test_a_request_overwritten_mid_switch_never_deadlocks_or_overlaps():
    sw = _switch(0)  # decode 16, prefill 116
    sw.request(2)  # decode grows to 112, prefill shrinks to 20
    assert sw.maybe_switch("prefill") == 2
    sw.slots[REQUESTED] = 1  # a controller that did not wait: both sides now grow (16 -> 64, 20 -> 68)
    assert sw.maybe_switch("decode") == 1  # 64 + prefill's 20 fit
    assert sw.maybe_switch("prefill") == 1  # 68 + decode's 64 fit
    assert sw.is_settled()


def test_overlap_switch_lets_the_growing_side_move_first():
    """split_switch overlap: no side waits for the other; the request settles once both have acked."""
    sw = SplitSwitch(np.zeros(4, dtype=np.int64), LADDER, overlap=True)
    sw.reset(1)
    assert sw.request(2)  # decode grows 64 -> 112 while prefill still acks 68: they share 44 SMs a while
    assert sw.maybe_switch("decode") == 2 and not sw.is_settled()
    assert not sw.request(0)  # the next request still waits for this one to settle
    assert sw.maybe_switch("prefill") == 2 and sw.is_settled()
    assert sw.request(0)  # prefill grows first this time
    assert sw.maybe_switch("prefill") == 0 and sw.maybe_switch("prefill") is None
    assert sw.maybe_switch("decode") == 0 and sw.is_settled()
    assert list(sw.slots) == [0, 0, 0, 2]


def test_overlap_switch_settles_every_request_under_concurrent_polling_threads():
    sw = SplitSwitch(np.zeros(4, dtype=np.int64), LADDER, overlap=True)
    sw.reset(0)
    stop = threading.Event()
    counts: list[int] = []

    def poll(side: str) -> None:
        mine, n = SplitSwitch(sw.slots, LADDER, overlap=True), 0
        while not stop.is_set():
            n += mine.maybe_switch(side) is not None
        counts.append(n)

    threads = [threading.Thread(target=poll, args=(side,)) for side in ("prefill", "decode")]
    for t in threads:
        t.start()
    rng = random.Random(1)
    targets = [rng.randrange(3) for _ in range(60)]
    _drive(sw, targets)
    stop.set()
    for t in threads:
        t.join()
    moves = sum(a != b for a, b in zip([0, *targets], targets))
    assert sw.is_settled() and sw.requested() == targets[-1] and counts == [moves, moves]


def test_switch_rejects_bad_slots_and_sides():
    with pytest.raises(ConfigError, match="int64"):
        SplitSwitch(np.zeros(4, dtype=np.int32), LADDER)
    with pytest.raises(ConfigError, match=">= 4"):
        SplitSwitch(np.zeros(3, dtype=np.int64), LADDER)
    ro = np.zeros(4, dtype=np.int64)
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="writable"):
        SplitSwitch(ro, LADDER)
    sw = _switch()
    with pytest.raises(ConfigError, match="unknown side 'both'"):
        sw.maybe_switch("both")
    with pytest.raises(ConfigError, match="index 3 outside"):
        sw.request(3)


def _side_loop(slots: np.ndarray, side: str, stop: threading.Event | None, flag: np.ndarray | None,
               overlaps: list) -> int:
    """Poll like a worker; check after every step that my acked entry and the other's never overlap."""
    sw = SplitSwitch(slots, LADDER)
    other = "prefill" if side == "decode" else "decode"
    switches = 0
    while not (stop.is_set() if stop is not None else flag[0]):
        if sw.maybe_switch(side) is not None:
            switches += 1
        mine, theirs = LADDER[sw.current(side)], LADDER[sw.current(other)]  # my slot is only written by me
        d, p = (mine, theirs) if side == "decode" else (theirs, mine)
        if d.decode_sms + p.prefill_sms > 132:
            overlaps.append((d.index, p.index))
    return switches


def _drive(sw: SplitSwitch, targets: list[int]) -> None:
    for t in targets:
        while not sw.request(t):
            pass
    while not sw.is_settled():
        pass


def test_switch_never_overlaps_under_concurrent_polling_threads():
    sw = _switch(0)
    overlaps: list = []
    stop = threading.Event()
    threads = [threading.Thread(target=_side_loop, args=(sw.slots, n, stop, None, overlaps))
               for n in ("prefill", "decode")]
    for t in threads:
        t.start()
    rng = random.Random(0)
    _drive(sw, [rng.randrange(3) for _ in range(60)])
    stop.set()
    for t in threads:
        t.join()
    assert not overlaps and sw.is_settled()


def _process_side(name: str, side: str, result: mp.Queue) -> None:
    shm = shared_memory.SharedMemory(name=name)
    try:
        buf = np.ndarray((6,), dtype=np.int64, buffer=shm.buf)
        overlaps: list = []
        switches = _side_loop(buf[:4], side, None, buf[4:5], overlaps)
        result.put((side, switches, overlaps))
        del buf
    finally:
        shm.close()


def test_switch_never_overlaps_between_two_processes():
    shm = shared_memory.SharedMemory(create=True, size=6 * 8)
    try:
        buf = np.ndarray((6,), dtype=np.int64, buffer=shm.buf)
        buf[:] = 0
        sw = SplitSwitch(buf[:4], LADDER)
        sw.reset(0)
        ctx = mp.get_context("spawn")
        result: mp.Queue = ctx.Queue()
        procs = [ctx.Process(target=_process_side, args=(shm.name, side, result)) for side in ("prefill", "decode")]
        for p in procs:
            p.start()
        targets = [2, 0, 1, 2, 1, 0, 2] * 5
        _drive(sw, targets)
        buf[4] = 1  # stop
        outs = {side: (n, overlaps) for side, n, overlaps in (result.get(timeout=60) for _ in procs)}
        for p in procs:
            p.join(timeout=30)
        assert outs["prefill"][1] == [] and outs["decode"][1] == []
        changes = sum(1 for a, b in zip([0, *targets], targets) if a != b)
        assert outs["prefill"][0] == changes and outs["decode"][0] == changes  # each side followed every request
        assert int(buf[PREFILL_ACK]) == int(buf[DECODE_ACK]) == targets[-1]
        del buf, sw
    finally:
        shm.close()
        shm.unlink()
