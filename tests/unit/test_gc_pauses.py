"""`bullet_ray.engine.gc_pauses`: every garbage collection timed (a step record's `gc_ms`, `gc_count`, `gc_gen`; the
share of a switch's latency spent collecting) and the heap frozen after start-up."""

from __future__ import annotations

import gc

import pytest

from bullet_ray.engine import gc_pauses
from bullet_ray.engine.gc_pauses import GcPauses, freeze_heap


def test_a_collection_is_timed_and_taken_once():
    pauses = GcPauses()
    pauses.install()
    pauses.install()  # once only
    try:
        assert gc.callbacks.count(pauses._on_gc) == 1
        pauses.take()  # whatever ran before this point
        gc.collect()  # a full collection: generation 2
        fields = pauses.take()
        assert fields["gc_count"] >= 1 and fields["gc_gen"] == 2 and fields["gc_ms"] >= 0
        assert pauses.num_collections >= 1
    finally:
        pauses.uninstall()
    assert pauses._on_gc not in gc.callbacks
    gc.collect()
    assert pauses.take() == {}  # uninstalled: nothing timed


def test_the_time_inside_a_window_counts_only_the_overlap(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(gc_pauses.time, "perf_counter", lambda: clock[0])
    pauses = GcPauses(keep=2)
    for start, end, gen in [(0.5, 0.6, 0), (1.0, 1.002, 2), (2.0, 2.001, 1)]:  # the first falls out (keep=2)
        clock[0] = start
        pauses._on_gc("start", {"generation": gen})
        clock[0] = end
        pauses._on_gc("stop", {"generation": gen})
    assert pauses.within_ms(1.001, 3.0) == pytest.approx(2.0)  # 1 ms of the first kept, all of the second
    assert pauses.within_ms(0.0, 0.9) == 0.0  # the first is no longer kept
    assert pauses.take() == {"gc_ms": pytest.approx(103.0), "gc_count": 3, "gc_gen": 2}
    pauses._on_gc("stop", {"generation": 0})  # a stop without its start (installed mid-collection): ignored
    assert pauses.take() == {}


def test_the_heap_freeze_moves_live_objects_out_of_the_collectors_reach():
    try:
        frozen = freeze_heap()
        assert frozen > 1000  # pytest's own objects at least
        # Frozen objects still die by reference count, so another thread of the session (Ray's) may free a few
        # between the freeze and this look; nothing but a freeze adds to the count.
        assert 0.99 * frozen <= gc.get_freeze_count() <= frozen
        assert len(gc.get_objects(2)) < frozen  # the oldest generation a pass walks no longer holds them
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
