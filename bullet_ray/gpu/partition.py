"""SM partitioning behind one interface: a ladder of complementary (decode, prefill) splits and a stream per side.

Backends, by name: "green" (green contexts through native/libsmctl, the default on GPU), "mps" (the MPS
thread percentage fixed per process: one entry, switching is a no-op that is reported), "none" (CPU:
the ladder exists and records choices, no hardware effect, no streams). `make_partitioner("auto", ...)`
takes green when the driver supports it, else none.

Switching protocol (SplitSwitch): a controller requests ladder entry k; each side polls at its step
boundary. The side that SHRINKS switches first and acknowledges (after its last step on the old
partition finished: the worker has synchronized its stream by then); the growing side switches only
once the shrinking side acknowledged. So the two sides' partitions never overlap.
"""

from __future__ import annotations

import abc
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from bullet_ray.errors import ConfigError

SideName = Literal["prefill", "decode", "both"]
SIDES = ("prefill", "decode", "both")
BACKENDS = ("auto", "green", "mps", "none")


@dataclass(frozen=True)
class LadderEntry:
    index: int
    decode_sms: int
    prefill_sms: int


def default_ladder(sm_count: int, granularity: int = 8, margin: int = 16) -> list[int]:
    """Decode SM counts from `margin` to sm_count - margin in steps of `granularity` (16, 24, ..., 112 on an H100)."""
    if sm_count < 2 * margin:
        return [max(1, sm_count // 2)]
    return list(range(margin, sm_count - margin + 1, granularity))


def _check_ladder(counts: list[int], sm_count: int) -> None:
    if not counts:
        raise ConfigError("decode_sm_counts", "the ladder is empty; give at least one decode SM count")
    for c in counts:
        if not isinstance(c, int) or c < 1 or c >= sm_count:
            raise ConfigError("decode_sm_counts", f"decode SM count {c!r} is outside [1, {sm_count - 1}] "
                              f"(the GPU has {sm_count} SMs)")


class SmPartitioner(abc.ABC):
    """A ladder of splits; `stream(index, side)` is where that side launches work on entry `index`."""

    name = "abstract"

    def __init__(self, side: SideName) -> None:
        if side not in SIDES:
            raise ConfigError("side", f"unknown side {side!r}; choose one of {SIDES}")
        self.side = side
        self.ladder: list[LadderEntry] = []
        self.current_index = 0
        self.history: list[int] = []

    def select(self, index: int) -> None:
        """Run on ladder entry `index` from the next step on."""
        if not 0 <= index < len(self.ladder):
            raise ConfigError("split_index", f"ladder index {index} outside [0, {len(self.ladder)})")
        self.current_index = index
        self.history.append(index)

    @abc.abstractmethod
    def stream(self, index: int, side: str) -> Any:
        """A torch stream bound to that side's SMs, or None (launch on the current stream)."""

    def current_stream(self, side: str) -> Any:
        return self.stream(self.current_index, side)

    def close(self) -> None:  # noqa: B027 - optional
        """Release streams and contexts."""


class NonePartitioner(SmPartitioner):
    """CPU or no partitioning: the ladder is bookkeeping only."""

    name = "none"

    def __init__(self, side: SideName, sm_count: int = 132, decode_sm_counts: list[int] | None = None) -> None:
        super().__init__(side)
        counts = decode_sm_counts or default_ladder(sm_count)
        _check_ladder(counts, sm_count)
        self.ladder = [LadderEntry(i, c, sm_count - c) for i, c in enumerate(counts)]

    def stream(self, index: int, side: str) -> Any:
        return None


class MpsPartitioner(SmPartitioner):
    """One fixed split from CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; other entries cannot be selected."""

    name = "mps"

    def __init__(self, side: SideName, sm_count: int) -> None:
        super().__init__(side)
        pct = float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100"))
        mine = max(1, round(sm_count * pct / 100))
        decode = mine if side == "decode" else sm_count - mine
        self.ladder = [LadderEntry(0, decode, sm_count - decode)]

    def stream(self, index: int, side: str) -> Any:
        return None


class GreenPartitioner(SmPartitioner):
    """Green contexts made by native/libsmctl; this process makes the streams of its side(s) only."""

    name = "green"

    def __init__(self, side: SideName, device: int = 0, decode_sm_counts: list[int] | None = None) -> None:
        super().__init__(side)
        import torch

        from bullet_ray.gpu import smctl

        caps = smctl.capabilities(device)
        if not caps.green_ctx_supported:
            raise smctl.NotSupportedError(caps.reason or "green contexts unsupported")
        counts = decode_sm_counts or default_ladder(caps.sm_count, max(caps.partition_alignment, 8))
        _check_ladder(counts, caps.sm_count)
        mask = {"decode": smctl.SIDE_DECODE, "prefill": smctl.SIDE_PREFILL,
                "both": smctl.SIDE_DECODE | smctl.SIDE_PREFILL}[side]
        # CUDA stream priorities: lower is higher; decode (latency-bound) gets the higher one
        self.native = smctl.NativeLadder(device, counts, mask, decode_priority=-1, prefill_priority=0)
        self.ladder = [LadderEntry(i, e.decode_sms, e.prefill_sms) for i, e in enumerate(self.native.entries)]
        dev = torch.device("cuda", device)
        self._streams: dict[tuple[int, str], Any] = {}
        for i, e in enumerate(self.native.entries):
            if e.decode_stream:
                self._streams[(i, "decode")] = torch.cuda.ExternalStream(e.decode_stream, device=dev)
            if e.prefill_stream:
                self._streams[(i, "prefill")] = torch.cuda.ExternalStream(e.prefill_stream, device=dev)

    def stream(self, index: int, side: str) -> Any:
        if (index, side) not in self._streams:
            raise ConfigError("side", f"this process did not make the {side} side (it holds {self.side!r})")
        return self._streams[(index, side)]

    def close(self) -> None:
        self._streams.clear()
        self.native.close()


def make_partitioner(backend: str, side: SideName, device: int = 0,
                     decode_sm_counts: list[int] | None = None, sm_count: int = 132) -> SmPartitioner:
    """The named backend; "auto" = green where the driver supports it, else none."""
    if backend not in BACKENDS:
        raise ConfigError("partition", f"unknown partition backend {backend!r}; choose one of {BACKENDS}")
    if backend == "none":
        return NonePartitioner(side, sm_count, decode_sm_counts)
    if backend == "mps":
        return MpsPartitioner(side, sm_count)
    if backend == "green":
        return GreenPartitioner(side, device, decode_sm_counts)
    from bullet_ray.gpu import smctl

    try:
        return GreenPartitioner(side, device, decode_sm_counts)
    except (smctl.NoDriverError, smctl.NotSupportedError):
        return NonePartitioner(side, sm_count, decode_sm_counts)


REQUESTED, PREFILL_ACK, DECODE_ACK, EPOCH = 0, 1, 2, 3


class SplitSwitch:
    """The switching protocol over 4 shared int64 slots: requested index, prefill ack, decode ack, epoch."""

    def __init__(self, slots: np.ndarray, ladder: list[LadderEntry]) -> None:
        if slots.dtype != np.int64 or slots.size < 4:
            raise ValueError("SplitSwitch needs a writable int64 array of >= 4 slots")
        self.slots = slots
        self.ladder = ladder

    def reset(self, index: int) -> None:
        self.slots[[REQUESTED, PREFILL_ACK, DECODE_ACK]] = index

    def request(self, index: int) -> None:
        if not 0 <= index < len(self.ladder):
            raise ConfigError("split_index", f"ladder index {index} outside [0, {len(self.ladder)})")
        self.slots[REQUESTED] = index
        self.slots[EPOCH] += 1

    def current(self, side: str) -> int:
        return int(self.slots[PREFILL_ACK if side == "prefill" else DECODE_ACK])

    def maybe_switch(self, side: str) -> int | None:
        """Call at a step boundary; returns the new index when this side switches now, else None."""
        mine_slot, other_slot = (PREFILL_ACK, DECODE_ACK) if side == "prefill" else (DECODE_ACK, PREFILL_ACK)
        target, mine = int(self.slots[REQUESTED]), int(self.slots[mine_slot])
        if target == mine or not 0 <= target < len(self.ladder):
            return None  # nothing to do, or a request this ladder cannot serve
        old, new = self.ladder[mine], self.ladder[target]
        shrinks = new.prefill_sms < old.prefill_sms if side == "prefill" else new.decode_sms < old.decode_sms
        if shrinks or int(self.slots[other_slot]) == target:
            self.slots[mine_slot] = target
            return target
        return None
