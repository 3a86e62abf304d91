"""Request ids remembered for a while, then forgotten: the front's finished ids that may not be reused yet (a worker
may still hold their sequence) and the decode worker's abort tombstones (an abort that came before its hand-off).

Insertion order is expiry order (one hold for all), so the oldest id is the first to expire: each `add` drops the
expired ones from the front, and at `max_ids` the oldest held one too."""

from __future__ import annotations

import time
from collections.abc import Iterator


class ExpiringIds:
    def __init__(self, hold_s: float, max_ids: int) -> None:
        if not hold_s >= 0 or max_ids < 1:
            raise ValueError(f"need hold_s >= 0 and max_ids >= 1, got {hold_s}, {max_ids}")
        self.hold_s = hold_s
        self.max_ids = max_ids
        self._until: dict[str, float] = {}  # id -> monotonic time its hold ends, oldest first

    def add(self, request_id: str) -> None:
        """Remember `request_id` for `hold_s` from now (again from now if it was remembered)."""
        now = time.monotonic()
        self._until.pop(request_id, None)  # re-added: to the end
        while self._until and (next(iter(self._until.values())) <= now or len(self._until) >= self.max_ids):
            del self._until[next(iter(self._until))]  # the expired, then (at the cap) the oldest held
        self._until[request_id] = now + self.hold_s

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` is within its hold (it stays remembered)."""
        return self._until.get(request_id, 0.0) > time.monotonic()

    def take(self, request_id: str) -> bool:
        """Whether `request_id` is within its hold; forgotten once asked."""
        until = self._until.pop(request_id, None)
        return until is not None and until > time.monotonic()

    def __len__(self) -> int:
        return len(self._until)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._until))
