"""A worker's view of the shared block allocator that holds freed blocks back while a step may still use them.

With asynchronous scheduling a sequence can be finished, aborted or preempted while the step that writes
its K/V still runs on the GPU. Its blocks must not reach the other worker (another process, another
stream) before that step has finished, or the other side's new K/V could be overwritten. This worker may
reuse them at once: its own later steps run after the in-flight one in stream order (a worker that
changes streams makes the new stream wait for the last step; bullet_ray.engine.worker.main).

Rules: `free` during an in-flight step parks the blocks, gated by the last launched step; `on_complete`
(called once the host has seen the oldest in-flight step, number n, finish) returns every parked block whose gate is <= n to the
shared pool. `allocate` takes parked blocks first. `num_free` counts both.
"""

from __future__ import annotations

from collections.abc import Iterable

from bullet_ray.engine.scheduler.base import BlockSource


class DeferredFree:
    def __init__(self, shared: BlockSource) -> None:
        self.shared = shared
        self.num_launched = 0  # serial of the last launched step
        self.num_completed = 0  # serial of the last step the host saw finish
        self._parked: list[tuple[int, list[int]]] = []  # (gate step, block ids)

    @property
    def num_free(self) -> int:
        return self.shared.num_free + self.num_parked

    @property
    def num_blocks(self) -> int:
        return self.shared.num_blocks

    @property
    def num_parked(self) -> int:
        return sum(len(ids) for _, ids in self._parked)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (parked ones count as free), 0..1."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    @property
    def is_step_in_flight(self) -> bool:
        return self.num_launched > self.num_completed

    def allocate(self, n: int) -> list[int] | None:
        """n blocks, parked ones first; None (nothing taken) when fewer than n are free."""
        if n <= 0:
            return []
        parked = self.num_parked
        from_shared = max(0, n - parked)
        shared_ids = self.shared.allocate(from_shared) if from_shared else []
        if shared_ids is None:
            return None
        ids: list[int] = []
        while len(ids) < n - from_shared:
            gate, blocks = self._parked[-1]
            take = min(len(blocks), n - from_shared - len(ids))
            ids.extend(blocks[len(blocks) - take:])
            del blocks[len(blocks) - take:]
            if not blocks:
                self._parked.pop()
        return ids + shared_ids

    def free(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        if not ids:
            return
        if self.is_step_in_flight:
            self._parked.append((self.num_launched, ids))
        else:
            self.shared.free(ids)

    def on_launch(self) -> None:
        self.num_launched += 1

    def on_complete(self) -> None:
        """The host saw the oldest in-flight step finish: hand back what only it could still touch."""
        self.num_completed += 1
        keep = [(gate, ids) for gate, ids in self._parked if gate > self.num_completed]
        for gate, ids in self._parked:
            if gate <= self.num_completed:
                self.shared.free(ids)
        self._parked = keep
