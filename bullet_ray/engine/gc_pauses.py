"""The Python garbage collector in an engine process: `freeze_heap` once a worker (or the Serve replica running the
engine front) has started, and `GcPauses`, which times every collection so the step log can show where one held up
the host and the metrics can count each process's (`bullet_gc_pause_seconds{process}`).

A collection stops the host thread that triggered it (allocation counts trigger them, so mostly while planning a
step or handling its outputs). After start-up a worker holds hundreds of thousands of long-lived objects (the model's
modules, the CUDA graphs, the tokenizer tables); an oldest-generation pass walks all of them, so without a freeze a
rare pass could hold the host for milliseconds, in the middle of a decode step in pieces that is waiting to follow a
requested split. `gc.freeze` moves every object alive after start-up into the permanent generation, which no
collection walks (vLLM's engine core and workers do the same after their start-up)."""

from __future__ import annotations

import gc
import time
from collections import deque
from typing import Any


def freeze_heap() -> int:
    """Collect every generation, then move every object that survived into the permanent generation (`gc.freeze`):
    later collections never walk them. Call once, after start-up (weights, graphs) and before serving; returns the
    number of objects now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class GcPauses:
    """Every garbage collection in this process, timed from gc.callbacks' "start" to its "stop" (perf_counter):
    the ones since the last `take` (a step record's fields) and the last `keep` (for `within_ms`: how much of a
    switch's latency the acking process spent collecting)."""

    def __init__(self, keep: int = 256) -> None:
        self._started: float | None = None
        self._recent: deque[tuple[float, float, int]] = deque(maxlen=keep)  # (start, end, generation)
        self._pending_s = 0.0  # since the last take
        self._pending_count = 0
        self._pending_gen = -1
        self.num_collections = 0
        self.total_s = 0.0

    def install(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        started, self._started = self._started, None
        if started is None:  # installed during a collection
            return
        generation = int(info.get("generation", -1))
        self._recent.append((started, now, generation))
        self._pending_s += now - started
        self._pending_count += 1
        self._pending_gen = max(self._pending_gen, generation)
        self.num_collections += 1
        self.total_s += now - started

    def take(self) -> dict[str, float | int]:
        """Step-record fields for the collections since the last take: `gc_ms` (their total time), `gc_count`,
        `gc_gen` (the oldest generation collected); {} when none ran."""
        if not self._pending_count:
            return {}
        fields = {"gc_ms": round(self._pending_s * 1e3, 4), "gc_count": self._pending_count, "gc_gen": self._pending_gen}
        self._pending_s, self._pending_count, self._pending_gen = 0.0, 0, -1
        return fields

    def within_ms(self, since: float, until: float) -> float:
        """Milliseconds of the collections (of the last `keep`) that overlap [since, until] (perf_counter), the
        overlap only."""
        total = 0.0
        for start, end, _ in reversed(self._recent):  # newest first: stop at the first that ended before `since`
            if end < since:
                break
            total += max(0.0, min(end, until) - max(start, since))
        return round(total * 1e3, 4)
