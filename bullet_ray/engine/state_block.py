"""A small block of shared host memory that both workers write every step and anyone may read.

Each side (prefill, decode) writes only its own row; the engine front, the policy and the SM-split
switch read both. Values are plain int64 (times in microseconds) so a write is one aligned store.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

import numpy as np
import torch

from bullet_ray.engine.shared_memory import ArenaHandle, TensorArena, TensorSpec


class Side(enum.IntEnum):
    PREFILL = 0
    DECODE = 1


class Field(enum.IntEnum):
    """Columns of a side's row."""

    STEP = 0  # steps completed
    NUM_SEQS = 1  # sequences in the last step's batch
    NUM_TOKENS = 2  # tokens computed in the last step
    NUM_CONTEXT_TOKENS = 3  # sum of context lengths attended over in the last step
    STEP_TIME_US = 4  # wall time of the last step
    SPLIT_INDEX = 5  # ladder entry this side runs on now
    NUM_QUEUED = 6  # sequences this side holds but did not run (waiting / preempted)
    HEARTBEAT_US = 7  # monotonic clock at the last write
    NUM_FIELDS = 8


# the SM-split switch protocol's slots (bullet_ray.gpu.partition.SplitSwitch reads these):
# requested index, prefill acked index, decode acked index, epoch
NUM_SWITCH_SLOTS = 4


@dataclass(frozen=True)
class StateBlockHandle:
    arena: ArenaHandle
    rows: TensorSpec
    switch: TensorSpec


class StateBlock:
    """rows: int64 [2, NUM_FIELDS]; switch: int64 [NUM_SWITCH_SLOTS]."""

    def __init__(self, arena: TensorArena, rows: TensorSpec, switch: TensorSpec) -> None:
        self._arena = arena
        self._rows_spec, self._switch_spec = rows, switch
        self.rows: np.ndarray = arena.view(rows).numpy()
        self.switch: np.ndarray = arena.view(switch).numpy()

    @classmethod
    def create(cls, path: str) -> StateBlock:
        arena = TensorArena.create(1024, "cpu", path)
        _, rows = arena.allocate((2, int(Field.NUM_FIELDS)), torch.int64)
        _, switch = arena.allocate((NUM_SWITCH_SLOTS,), torch.int64)
        return cls(arena, rows, switch)

    @classmethod
    def attach(cls, handle: StateBlockHandle) -> StateBlock:
        return cls(TensorArena.attach(handle.arena), handle.rows, handle.switch)

    def export(self) -> StateBlockHandle:
        return StateBlockHandle(self._arena.handle, self._rows_spec, self._switch_spec)

    def publish(self, side: Side, *, num_seqs: int, num_tokens: int, num_context_tokens: int,
                step_time_us: int, num_queued: int, split_index: int = 0) -> None:
        """Record one finished step of `side`."""
        row = self.rows[int(side)]
        row[Field.NUM_SEQS] = num_seqs
        row[Field.NUM_TOKENS] = num_tokens
        row[Field.NUM_CONTEXT_TOKENS] = num_context_tokens
        row[Field.STEP_TIME_US] = step_time_us
        row[Field.NUM_QUEUED] = num_queued
        row[Field.SPLIT_INDEX] = split_index
        row[Field.HEARTBEAT_US] = time.monotonic_ns() // 1000
        row[Field.STEP] += 1

    def read(self, side: Side) -> dict[str, int]:
        row = self.rows[int(side)].copy()
        return {f.name.lower(): int(row[f]) for f in Field if f is not Field.NUM_FIELDS}

    def close(self) -> None:
        self._arena.close()
