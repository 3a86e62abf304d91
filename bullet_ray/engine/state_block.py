"""A small block of shared host memory that both workers write every step and anyone may read.

Each side (prefill, decode) writes only its own row; the engine front, the policy and the SM-split
switch read both. Values are plain int64 (times in microseconds) so a write is one aligned store.

Besides the rows: the split switch's slots (bullet_ray.gpu.switch), the policy's slots (the last split
decision, made by the prefill worker at its step boundaries: when, which entry, why, what it cost, the
predicted TTFT of a new request, the time from a decision to both sides launching on the new split (their acks)
and to its taking effect (no step of either side left on the old split: its drain)), the mixed fallback's
hand-over counters (`num_handed_prompts_held`), and three rings the front reads for the metrics: each side's last
RING_SIZE steps (measured and predicted time, ladder entry), the last RING_SIZE decision-to-new-split times and
the last RING_SIZE decision-to-drained times.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from bullet_ray.engine.shared_memory import ArenaHandle, TensorArena, TensorSpec
from bullet_ray.gpu.switch import DECODE_ACK, EPOCH, NUM_SWITCH_SLOTS, PREFILL_ACK, REQUESTED


class Side(enum.IntEnum):
    PREFILL = 0
    DECODE = 1

    @property
    def other(self) -> Side:
        return Side.DECODE if self is Side.PREFILL else Side.PREFILL


class Field(enum.IntEnum):
    """Columns of a side's row."""

    STEP = 0  # steps completed
    NUM_SEQS = 1  # sequences in the last step's batch
    NUM_TOKENS = 2  # tokens computed in the last step
    NUM_CONTEXT_TOKENS = 3  # sum of context lengths attended over in the last step
    STEP_TIME_US = 4  # wall time of the last step
    SPLIT_INDEX = 5  # ladder entry this side's last published step ran on (launched on, with layer groups)
    NUM_QUEUED = 6  # sequences this side holds but did not run (waiting / preempted)
    HEARTBEAT_US = 7  # monotonic clock at the last write
    PREDICTED_STEP_US = 8  # the performance model's prediction of the last step (0: none)
    QUEUED_TOKENS = 9  # prompt tokens this side holds but did not run yet
    IS_ACTIVE = 10  # 1 while this side has work (it will step again), else 0
    INFLIGHT_INDEX = 11  # ladder entry of this side's oldest launched, uncollected step + 1 (0: none in flight)
    GC_US = 12  # time this side's worker spent in garbage collections since it started (engine/gc_pauses.py)
    GC_COUNT = 13  # how many collections that was
    NUM_FIELDS = 14


MAX_DECISION_REASONS = 16  # reasons Policy.DECISIONS_BY_REASON counts (bullet_ray.policy.state.SplitReason has 10)


class Policy(enum.IntEnum):
    """The policy's slots (written by the side that decides, and by the sides that complete a switch)."""

    NUM_DECISIONS = 0  # split decisions made
    DECISION_US = 1  # monotonic clock of the last decision
    DECISION_INDEX = 2  # ladder entry it chose
    DECISION_REASON = 3  # index of bullet_ray.policy.state.SplitReason in REASONS
    DECISION_COST_US = 4  # time the decision took
    PREDICTED_TTFT_US = 5  # predicted TTFT of a request arriving now (average prompt), 0: unknown
    PENDING_SWITCH_US = 6  # decision time of the switch in flight (0: none)
    NUM_SWITCHES = 7  # switches completed (both sides on the new entry)
    LAST_SWITCH_US = 8  # decision-to-new-split time of the last completed switch
    MIN_INDEX = 9  # lowest ladder entry the decider may choose (the cluster controller's bounds)
    MAX_INDEX_PLUS_ONE = 10  # highest allowed entry + 1 (0: no upper bound)
    TTFT_TARGET_US = 11  # SLO targets pushed at run time (the cluster controller's); 0: the config's
    TPOT_TARGET_US = 12
    # the mixed fallback's hand-over counters, each written by one process only and never decreasing
    # (`StateBlock.num_handed_prompts_held`)
    PROMPTS_HANDED_OVER = 13  # prompts the prefill worker handed to the decode worker, in total (prefill)
    HANDED_PROMPTS_DONE = 14  # of those, prefilled (promoted to decode's running set) or aborted there (decode)
    HANDED_PROMPTS_DROPPED = 15  # of those, dropped by the front in transit: finished or aborted meanwhile (front)
    PREDICTED_TTFT_TOKENS = 16  # the prompt length PREDICTED_TTFT_US is for
    PREDICTED_TTFT_NS_PER_TOKEN = 17  # how much longer it is per prompt token more (ns), 0: unknown
    # a switch's drain: both sides ack at their next launch, but a step either launched before (launched ahead,
    # or in flight in overlap mode) still runs on the old entry; the switch has taken effect once none does
    DRAIN_START_US = 18  # decision time of the settled switch whose older steps still run (0: none)
    DRAIN_INDEX = 19  # the entry that switch settled on
    NUM_DRAINS = 20  # settled switches whose older steps have all ended (each timed)
    LAST_DRAIN_US = 21  # decision to no step of either side on another entry, of the last of them
    NUM_DRAINS_OVERTAKEN = 22  # settled switches a newer request overtook before their older steps ended (not timed)
    # split decisions by reason: slot DECISIONS_BY_REASON + i counts the decisions whose DECISION_REASON is i, for i
    # below MAX_DECISION_REASONS (by the deciding side; `read_decisions_by_reason`)
    DECISIONS_BY_REASON = 23
    NUM_SLOTS = DECISIONS_BY_REASON + MAX_DECISION_REASONS


RING_SIZE = 64
STEP_RING_FIELDS = 3  # measured_us, predicted_us, split index


# the SM-split switch protocol's slots (bullet_ray.gpu.switch.SplitSwitch reads these): NUM_SWITCH_SLOTS of them,
# the requested index, prefill's and decode's acked index, the epoch


def _is_settled(sw: np.ndarray) -> bool:
    """Both sides run on the requested entry (`SplitSwitch.is_settled` on these slots)."""
    return int(sw[REQUESTED]) == int(sw[PREFILL_ACK]) == int(sw[DECODE_ACK])


@dataclass(frozen=True)
class StateBlockHandle:
    arena: ArenaHandle
    rows: TensorSpec
    switch: TensorSpec
    policy: TensorSpec
    steps: TensorSpec
    switches: TensorSpec
    drains: TensorSpec


class StateBlock:
    """rows: int64 [2, NUM_FIELDS]; switch: int64 [NUM_SWITCH_SLOTS]; policy: int64 [Policy.NUM_SLOTS];
    steps: int64 [2, RING_SIZE, STEP_RING_FIELDS]; switches, drains: int64 [RING_SIZE]."""

    def __init__(self, arena: TensorArena, rows: TensorSpec, switch: TensorSpec, policy: TensorSpec,
                 steps: TensorSpec, switches: TensorSpec, drains: TensorSpec) -> None:
        self._arena = arena
        self._specs = (rows, switch, policy, steps, switches, drains)
        self.rows: np.ndarray = arena.view(rows).numpy()
        self.switch: np.ndarray = arena.view(switch).numpy()
        self.policy: np.ndarray = arena.view(policy).numpy()
        self.steps: np.ndarray = arena.view(steps).numpy()
        self.switches: np.ndarray = arena.view(switches).numpy()
        self.drains: np.ndarray = arena.view(drains).numpy()
        # the backing file, for `flock` (opened now: the owner unlinks it when it closes, maybe before our last use)
        self._lock_fd: int | None = os.open(arena.handle.path, os.O_RDWR) if arena.handle.path else None

    @classmethod
    def create(cls, path: str) -> StateBlock:
        arena = TensorArena.create(8192, "cpu", path)
        _, rows = arena.allocate((2, int(Field.NUM_FIELDS)), torch.int64)
        _, switch = arena.allocate((NUM_SWITCH_SLOTS,), torch.int64)
        _, policy = arena.allocate((int(Policy.NUM_SLOTS),), torch.int64)
        _, steps = arena.allocate((2, RING_SIZE, STEP_RING_FIELDS), torch.int64)
        _, switches = arena.allocate((RING_SIZE,), torch.int64)
        _, drains = arena.allocate((RING_SIZE,), torch.int64)
        return cls(arena, rows, switch, policy, steps, switches, drains)

    @classmethod
    def attach(cls, handle: StateBlockHandle) -> StateBlock:
        return cls(TensorArena.attach(handle.arena), handle.rows, handle.switch, handle.policy, handle.steps,
                   handle.switches, handle.drains)

    def export(self) -> StateBlockHandle:
        return StateBlockHandle(self._arena.handle, *self._specs)

    def publish(self, side: Side, *, num_seqs: int, num_tokens: int, num_context_tokens: int,
                step_time_us: int, num_queued: int, split_index: int = 0, gc_us: int = 0,
                gc_count: int = 0) -> None:
        """Record one finished step of `side`; `gc_us` / `gc_count`: the worker's garbage collections so far."""
        row = self.rows[int(side)]
        row[Field.GC_US] = gc_us
        row[Field.GC_COUNT] = gc_count
        row[Field.NUM_SEQS] = num_seqs
        row[Field.NUM_TOKENS] = num_tokens
        row[Field.NUM_CONTEXT_TOKENS] = num_context_tokens
        row[Field.STEP_TIME_US] = step_time_us
        row[Field.NUM_QUEUED] = num_queued
        row[Field.SPLIT_INDEX] = split_index
        row[Field.HEARTBEAT_US] = time.monotonic_ns() // 1000
        row[Field.STEP] += 1

    def annotate(self, side: Side, *, predicted_step_us: int, queued_tokens: int, is_active: bool) -> None:
        """The policy's extras of the step `publish` is about to record (call it first: `publish` bumps
        STEP last, so a reader that sees the new STEP sees these too; `record_ring` the same way)."""
        row = self.rows[int(side)]
        row[Field.PREDICTED_STEP_US] = predicted_step_us
        row[Field.QUEUED_TOKENS] = queued_tokens
        row[Field.IS_ACTIVE] = int(is_active)

    def set_inflight_index(self, side: Side, index: int | None) -> None:
        """The ladder entry `side`'s oldest launched, not yet collected step runs on (None: nothing in flight)."""
        self.rows[int(side)][Field.INFLIGHT_INDEX] = 0 if index is None else index + 1

    def inflight_index(self, side: Side) -> int | None:
        """What `set_inflight_index` last wrote for `side`."""
        value = int(self.rows[int(side)][Field.INFLIGHT_INDEX])
        return value - 1 if value > 0 else None

    def mark_active(self, side: Side) -> None:
        """`side` is about to step (a CPU side marks it at plan, before it reads the other's: worker/roles/side.py)."""
        self.rows[int(side)][Field.IS_ACTIVE] = 1

    def mark_idle(self, side: Side) -> None:
        """`side` has no work left (nothing queued, nothing in flight) since its last published step."""
        self.rows[int(side)][Field.IS_ACTIVE] = 0

    def record_ring(self, side: Side, measured_us: int, predicted_us: int, split_index: int) -> None:
        """Enter the step `publish` is about to record (STEP does not count it yet) into `side`'s ring, so a
        reader that sees the new STEP finds its entry; `split_index` -1: a step across a switch, on no one entry
        (`StepRecorder.record`)."""
        step = int(self.rows[int(side)][Field.STEP])
        self.steps[int(side), step % RING_SIZE] = (measured_us, predicted_us, split_index)

    def recent_steps(self, side: Side, after_step: int) -> tuple[int, list[tuple[int, int, int]]]:
        """(`side`'s step count now, its ring entries for steps after `after_step`, at most RING_SIZE - 1: the
        oldest slot may already hold the next step, entered before its count is published)."""
        step = int(self.rows[int(side)][Field.STEP])
        first = max(after_step, step - RING_SIZE + 1)
        ring = self.steps[int(side)].copy()
        return step, [tuple(int(v) for v in ring[s % RING_SIZE]) for s in range(first, step)]  # type: ignore[misc]

    def record_decision(self, index: int, reason: int, cost_us: int, predicted_ttft_us: int,
                        is_switch: bool, predicted_ttft_tokens: int = 0, predicted_ttft_ns_per_token: int = 0) -> None:
        """A split decision (by the deciding side); `is_switch`: it asked for a new entry. The predicted TTFT is
        that of a request of `predicted_ttft_tokens` arriving now, longer by `predicted_ttft_ns_per_token` per
        prompt token more (0: unknown)."""
        p, now = self.policy, time.monotonic_ns() // 1000
        p[Policy.DECISION_US] = now
        p[Policy.DECISION_INDEX] = index
        p[Policy.DECISION_REASON] = reason
        p[Policy.DECISION_COST_US] = cost_us
        p[Policy.PREDICTED_TTFT_US] = predicted_ttft_us
        p[Policy.PREDICTED_TTFT_TOKENS] = predicted_ttft_tokens
        p[Policy.PREDICTED_TTFT_NS_PER_TOKEN] = predicted_ttft_ns_per_token
        if is_switch:
            with self._locked():  # not between another side's read of the last pending switch and its clear
                p[Policy.PENDING_SWITCH_US] = now
        if 0 <= reason < MAX_DECISION_REASONS:
            p[Policy.DECISIONS_BY_REASON + reason] += 1
        p[Policy.NUM_DECISIONS] += 1

    def request_switch(self, index: int) -> bool:
        """A split switch asked for outside the policy's decisions (the engine front's `request_split`: by hand,
        or to move inside the controller's bounds): the requested entry, the epoch and, where a side has to move,
        the switch's start (timed like a decision's until both sides run on it) written together under the lock,
        so a switch that settles meanwhile cannot take this one's start. Returns whether a side has to move."""
        sw = self.switch
        with self._locked():
            moves = not (_is_settled(sw) and int(sw[REQUESTED]) == index)
            sw[REQUESTED] = index
            sw[EPOCH] += 1
            if moves:
                self.policy[Policy.PENDING_SWITCH_US] = time.monotonic_ns() // 1000
        return moves

    def set_split_bounds(self, min_index: int, max_index: int) -> None:
        """The ladder entries the deciding side may choose (inclusive), set by the engine front."""
        self.policy[Policy.MIN_INDEX] = min_index
        self.policy[Policy.MAX_INDEX_PLUS_ONE] = max_index + 1

    def set_slo_targets(self, ttft_s: float, tpot_s: float) -> None:
        """Targets the deciding side uses from its next decision on (set by the engine front)."""
        self.policy[Policy.TTFT_TARGET_US] = int(ttft_s * 1e6)
        self.policy[Policy.TPOT_TARGET_US] = int(tpot_s * 1e6)

    def slo_targets(self) -> tuple[float, float] | None:
        """(ttft_s, tpot_s) pushed with `set_slo_targets`, or None while none was pushed."""
        ttft_us, tpot_us = int(self.policy[Policy.TTFT_TARGET_US]), int(self.policy[Policy.TPOT_TARGET_US])
        return (ttft_us / 1e6, tpot_us / 1e6) if ttft_us > 0 and tpot_us > 0 else None

    def clamp_to_bounds(self, index: int) -> int:
        """`index` moved inside the bounds set by `set_split_bounds` (none set: unchanged)."""
        lo, hi = int(self.policy[Policy.MIN_INDEX]), int(self.policy[Policy.MAX_INDEX_PLUS_ONE]) - 1
        index = max(index, lo)
        return min(index, hi) if hi >= 0 else index

    def count_handed_prompts(self, slot: Policy, num: int = 1) -> None:
        """Add `num` to one of the hand-over counters (PROMPTS_HANDED_OVER, HANDED_PROMPTS_DONE,
        HANDED_PROMPTS_DROPPED); only the process named beside the slot writes it."""
        if num:
            self.policy[slot] += num

    def num_handed_prompts_held(self) -> int:
        """Prompts the mixed fallback handed to the decode worker that it has not finished prefilling: held there
        (possibly prefilled part-way) or still in transit through the front. The prefill worker writes the total
        itself, so its reading is never below the truth (the others' counters only lag); 0 means none."""
        p = self.policy
        return int(p[Policy.PROMPTS_HANDED_OVER]) - int(p[Policy.HANDED_PROMPTS_DONE]) \
            - int(p[Policy.HANDED_PROMPTS_DROPPED])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """An exclusive lock across processes (flock on the block's backing file), for a check-then-write that two
        processes may run at once."""
        assert self._lock_fd is not None, "a state block is a CPU arena with a backing file"
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def record_switch_done(self) -> int | None:
        """Both sides run on the requested entry now (called by the side that acked last): the
        decision-to-new-split time in microseconds, or None if no decision was pending. When both sides ack
        within microseconds each may see the switch settled and call this: the lock lets only the first count it."""
        with self._locked():
            return self._record_switch_done()

    def _record_switch_done(self) -> int | None:
        p, sw = self.policy, self.switch
        pending = int(p[Policy.PENDING_SWITCH_US])
        requested = int(sw[REQUESTED])  # read once: the deciding side may request anew meanwhile (unlocked)
        if pending == 0 or not requested == int(sw[PREFILL_ACK]) == int(sw[DECODE_ACK]):
            return None  # none pending, not acked by both yet, or a newer request came after the acks
        p[Policy.PENDING_SWITCH_US] = 0
        latency = time.monotonic_ns() // 1000 - pending
        self.switches[int(p[Policy.NUM_SWITCHES]) % RING_SIZE] = latency
        p[Policy.LAST_SWITCH_US] = latency
        p[Policy.NUM_SWITCHES] += 1
        if p[Policy.DRAIN_START_US]:  # the last switch's older steps still ran: this one overtook it
            p[Policy.NUM_DRAINS_OVERTAKEN] += 1
        p[Policy.DRAIN_START_US] = pending
        p[Policy.DRAIN_INDEX] = requested
        return latency

    def record_drain_if_done(self) -> tuple[int, int] | None:
        """Called by a side after it published its oldest step in flight (`set_inflight_index`): once a settled
        switch has no step of either side left on another entry (each side's oldest uncollected step is on the new
        one, or none is in flight), (the time from its decision to then in microseconds, the entry): the switch
        has taken effect, every SM runs the new split's work; else None. A newer request before that ends the
        wait untimed (`NUM_DRAINS_OVERTAKEN`). One unlocked read while nothing waits."""
        if not self.policy[Policy.DRAIN_START_US]:
            return None
        with self._locked():
            p = self.policy
            start, index = int(p[Policy.DRAIN_START_US]), int(p[Policy.DRAIN_INDEX])
            if not start:
                return None  # the other side timed it meanwhile
            if int(self.switch[REQUESTED]) != index:
                p[Policy.DRAIN_START_US] = 0
                p[Policy.NUM_DRAINS_OVERTAKEN] += 1
                return None
            if any(self.inflight_index(side) not in (None, index) for side in Side):
                return None
            p[Policy.DRAIN_START_US] = 0
            latency = time.monotonic_ns() // 1000 - start
            self.drains[int(p[Policy.NUM_DRAINS]) % RING_SIZE] = latency
            p[Policy.LAST_DRAIN_US] = latency
            p[Policy.NUM_DRAINS] += 1
            return latency, index

    def recent_switches(self, after: int) -> tuple[int, list[int]]:
        """(switches completed, the decision-to-new-split times of those after `after`, microseconds)."""
        return self._recent(self.switches, Policy.NUM_SWITCHES, after)

    def recent_drains(self, after: int) -> tuple[int, list[int]]:
        """(switches drained, the decision-to-drained times of those after `after`, microseconds)."""
        return self._recent(self.drains, Policy.NUM_DRAINS, after)

    def _recent(self, ring: np.ndarray, count: Policy, after: int) -> tuple[int, list[int]]:
        n = int(self.policy[count])
        values = ring.copy()
        return n, [int(values[i % RING_SIZE]) for i in range(max(after, n - RING_SIZE), n)]

    def read_policy(self) -> dict[str, int]:
        p = self.policy.copy()
        return {f.name.lower(): int(p[f]) for f in Policy if f not in (Policy.NUM_SLOTS, Policy.DECISIONS_BY_REASON)}

    def read_decisions_by_reason(self) -> list[int]:
        """Split decisions so far, by reason index (bullet_ray.engine.worker.policy_link.REASONS order)."""
        start = int(Policy.DECISIONS_BY_REASON)
        return [int(v) for v in self.policy[start:start + MAX_DECISION_REASONS].tolist()]

    def read(self, side: Side) -> dict[str, int]:
        row = self.rows[int(side)].copy()
        return {f.name.lower(): int(row[f]) for f in Field if f is not Field.NUM_FIELDS}

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        self._arena.close()
