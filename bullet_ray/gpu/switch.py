"""The split-switch protocol: move both sides to another ladder entry, in one of two modes: disjoint (their SMs
never overlap) or overlap (neither side waits; the engine's default, `split_switch: overlap`).

State: a writable numpy int64 array of >= 4 slots shared by the controller (engine front) and the two
workers (the engine hands in a view of its shared-memory state block):

    slot 0  REQUESTED    ladder index the controller asks for
    slot 1  PREFILL_ACK  ladder index the prefill side runs on now
    slot 2  DECODE_ACK   ladder index the decode side runs on now
    slot 3  EPOCH        incremented by every request (for logs and metrics)

Disjoint mode (`overlap=False`, engine `split_switch: disjoint`). Each side calls `maybe_switch(side)` at its
step boundary, after the work it launched on its
current partition has finished (a worker synchronizes its stream at the end of a step to read the
sampled tokens, so that holds). A side whose partition shrinks (or stays) switches at once and acks.
A side whose partition grows switches only when its new SMs are free: when its new SM count plus the
other side's acked SM count fits the GPU (in the ordinary sequence, once the shrinking side acked the
target). Ladder splits are nested (a smaller decode group is part of a larger one: the driver carves
groups in a fixed SM order, checked on the H100 by the SM ids kernels ran on), so "counts fit" means
"SM sets are disjoint".

The controller publishes a request only when the previous one has settled (`request` returns False
otherwise; ask again later): the two sides then act on the same target, and at most one of them grows.
A request written while another is in flight (by a controller that bypasses `request`) still never
deadlocks: the growing rule is checked against the other side's acked partition, not its target.

Overlap mode (`overlap=True`, engine `split_switch: overlap`, its default since the H100 A/B in
benchmarks/results/serve_h100_m2v): no growing rule. Each side acks at its next
step boundary, without finishing its step in flight (its next launch waits on it, on the new SMs), so the
growing side takes its new SMs at once and shares them with the other side's last step on its old partition
until that step ends. A switch then takes until both sides' next launches, not a step of the shrinking side
followed by the growing side's next boundary; the price is that brief sharing (the steps that run beside the
other side's step on another entry are flagged `across_switch` and not learned from: engine/worker/roles/).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from bullet_ray.errors import ConfigError

REQUESTED, PREFILL_ACK, DECODE_ACK, EPOCH = 0, 1, 2, 3
NUM_SWITCH_SLOTS = 4


class _Entry(Protocol):
    @property
    def decode_sms(self) -> int: ...

    @property
    def prefill_sms(self) -> int: ...


class SplitSwitch:
    """The protocol over shared slots; one instance per process (controller, prefill, decode). `overlap` defaults
    to False here (the protocol's strict form); the engine passes its `split_switch` setting (default overlap)."""

    def __init__(self, slots: np.ndarray, ladder: Sequence[_Entry], sm_count: int | None = None,
                 overlap: bool = False) -> None:
        if not isinstance(slots, np.ndarray) or slots.dtype != np.int64 or slots.ndim != 1 \
                or slots.size < NUM_SWITCH_SLOTS or not slots.flags.writeable:
            raise ConfigError("switch_slots", f"need a writable 1-d int64 numpy array of >= {NUM_SWITCH_SLOTS} "
                              f"slots, got {type(slots).__name__} {getattr(slots, 'dtype', '')} "
                              f"{getattr(slots, 'shape', '')}")
        if not ladder:
            raise ConfigError("ladder", "the ladder is empty")
        self.slots = slots
        self.ladder = list(ladder)
        # the GPU's SMs: every entry splits all of them (decode + prefill)
        self.sm_count = sm_count if sm_count is not None else max(e.decode_sms + e.prefill_sms for e in self.ladder)
        self.overlap = overlap  # the growing side does not wait for the shrinking side's ack (module docstring)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.ladder):
            raise ConfigError("split_index", f"ladder index {index} outside [0, {len(self.ladder)})")

    def reset(self, index: int) -> None:
        """Both sides start on entry `index` (before any worker polls)."""
        self._check_index(index)
        self.slots[REQUESTED] = index
        self.slots[PREFILL_ACK] = index
        self.slots[DECODE_ACK] = index

    def is_settled(self) -> bool:
        """Both sides run on the requested entry."""
        s = self.slots
        return int(s[PREFILL_ACK]) == int(s[REQUESTED]) == int(s[DECODE_ACK])

    def request(self, index: int) -> bool:
        """Ask both sides to move to `index`. False (nothing written) while an earlier request is in flight;
        call again later. True when published, or when `index` is already the request."""
        self._check_index(index)
        if int(self.slots[REQUESTED]) == index:
            return True
        if not self.is_settled():
            return False
        self.slots[REQUESTED] = index
        self.slots[EPOCH] += 1
        return True

    def requested(self) -> int:
        """The ladder index last asked for."""
        return int(self.slots[REQUESTED])

    def epoch(self) -> int:
        """Requests made so far (a step that sees it change between its launch and its collect ran while the
        split was asked to move)."""
        return int(self.slots[EPOCH])

    def shares_sms(self, side: str, index: int, other_index: int) -> bool:
        """Whether `side` on entry `index` and the other side on `other_index` hold SMs in common (the groups
        are nested, so that is: their counts overflow the GPU)."""
        other = "decode" if side == "prefill" else "prefill"
        return self._sms(side, index) + self._sms(other, other_index) > self.sm_count

    def current(self, side: str) -> int:
        """The ladder index `side` ("prefill" or "decode") has acked."""
        return int(self.slots[self._slot(side)])

    @staticmethod
    def _slot(side: str) -> int:
        if side == "prefill":
            return PREFILL_ACK
        if side == "decode":
            return DECODE_ACK
        raise ConfigError("side", f"unknown side {side!r}; the switch protocol has 'prefill' and 'decode'")

    def _sms(self, side: str, index: int) -> int:
        e = self.ladder[index]
        return e.prefill_sms if side == "prefill" else e.decode_sms

    def must_finish_step(self, side: str, target: int) -> bool:
        """Whether `side` must finish its work in flight before it acks `target` (read once with `requested`,
        then passed here and to `maybe_switch`): it has not acked it yet, and not in overlap mode. (Only a
        shrinking side's promise needs it; a growing side finishes too, as the disjoint mode ran on the H100
        before overlap mode existed.)"""
        return not self.overlap and target != int(self.slots[self._slot(side)])

    def maybe_switch(self, side: str, target: int | None = None) -> int | None:
        """At `side`'s step boundary (its earlier work finished, unless in overlap mode): the new ladder index
        if this side switches now (it has acked it), else None (nothing requested, or the other side must
        shrink first). `target`: the request as read before this side finished its step (default: now)."""
        mine_slot = self._slot(side)
        other = "decode" if side == "prefill" else "prefill"
        target = int(self.slots[REQUESTED]) if target is None else target
        mine = int(self.slots[mine_slot])
        if target == mine or not 0 <= target < len(self.ladder):
            return None  # nothing to do, or a request this ladder cannot serve
        new_sms = self._sms(side, target)
        if new_sms > self._sms(side, mine) and not self.overlap:
            other_sms = self._sms(other, int(self.slots[self._slot(other)]))
            if new_sms + other_sms > self.sm_count:
                return None  # growing onto SMs the other side still holds: wait for it to shrink
        self.slots[mine_slot] = target
        return target
