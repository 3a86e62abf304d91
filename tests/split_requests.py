"""A thread that asks an engine for another SM split every few milliseconds while a block runs: the tests of split
switches under load (CPU integration, GPU)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def splits_requested(engine: Any, period_s: float, num_entries: int | None = None) -> Iterator[dict[str, set[int]]]:
    """While the block runs, request ladder entry i % `num_entries` (default: the engine's `split_ladder_size`) every
    `period_s`, noting where each side was (`split_indexes`); yields {side: entries seen}. At the end the thread is
    stopped: one still alive after 5 s, or an error it raised, fails the test."""
    size = num_entries if num_entries is not None else engine.split_ladder_size()
    seen: dict[str, set[int]] = {}
    errors: list[BaseException] = []
    stop = threading.Event()

    def keep_switching() -> None:
        i = 0
        try:
            while not stop.is_set():
                engine.request_split(i % size)
                i += 1
                for side, index in engine.split_indexes().items():
                    seen.setdefault(side, set()).add(index)
                time.sleep(period_s)
        except BaseException as e:  # noqa: BLE001 - surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    thread = threading.Thread(target=keep_switching)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive() and not errors, errors
