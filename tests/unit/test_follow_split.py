"""A worker's `follow_split` at its step boundary, on fakes: in disjoint mode a side collects its step in flight
before it acks a new split (the SMs it gives up are free when it says so) and a side that grows waits for the
other's ack; in overlap mode both ack at once and a step in flight keeps running on the old partition, recorded
and published against the entry it ran on."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from bullet_ray.engine.worker.main import WorkerBase
from bullet_ray.gpu.partition import NonePartitioner, SplitSwitch


class _Side(WorkerBase):
    """Only what `follow_split` touches: a partitioner, the switch over shared slots, a step in flight."""

    def __init__(self, side: str, slots: np.ndarray, overlap: bool) -> None:  # no engine resources
        self.partitioner = NonePartitioner(side)
        self.partitioner.select(1)
        self.switch = SplitSwitch(slots, self.partitioner.ladder, overlap=overlap)
        self.inflight = SimpleNamespace(ladder_index=1)
        self.collected: list[int] = []

    def _finish_inflight(self) -> None:
        self.collected.append(self.inflight.ladder_index)
        self.inflight = None


@pytest.mark.parametrize("overlap", [False, True])
def test_a_side_collects_its_step_before_it_moves_only_when_disjoint(overlap: bool):
    slots = np.zeros(4, dtype=np.int64)
    decode, prefill = _Side("decode", slots, overlap), _Side("prefill", slots, overlap)
    decode.switch.reset(1)
    top = len(decode.partitioner.ladder) - 1
    assert decode.switch.request(top)  # decode grows, prefill shrinks
    decode.follow_split()
    # disjoint: decode collects its step, then waits for prefill's SMs; overlap: it moves, its step still running
    assert decode.partitioner.current_index == (top if overlap else 1)
    assert decode.collected == ([] if overlap else [1])
    prefill.follow_split()
    assert prefill.partitioner.current_index == top
    if overlap:  # the shrinking side acked with its step still running on the old partition
        assert prefill.collected == [] and prefill.inflight is not None
    else:  # the shrinking side collected its step first, then acked
        assert prefill.collected == [1] and prefill.inflight is None
        decode.follow_split()
        assert decode.partitioner.current_index == top and decode.inflight is None
    assert decode.switch.is_settled()


def test_overlap_mode_records_a_step_against_the_entry_it_ran_on(tmp_path):
    """A step planned on entry 1, collected after the side moved to entry 0: the model learns it, the ring and
    the published row carry it, as entry 1's."""
    from bullet_ray.engine.state_block import Field, Side, StateBlock
    from bullet_ray.engine.worker.policy_link import StepRecorder
    from bullet_ray.perf.kernels import StepShape

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        observed: list[tuple[int, int]] = []
        model = SimpleNamespace(observe=lambda shape, sms, busy, index, s: observed.append((sms, index)))
        partitioner = NonePartitioner("decode")
        worker = SimpleNamespace(res=SimpleNamespace(state=block), side=Side.DECODE, partitioner=partitioner,
                                 config=SimpleNamespace(step_log_path=None))
        recorder = StepRecorder(worker, model)  # type: ignore[arg-type]
        partitioner.select(0)  # the side moved on since the launch on entry 1
        recorder.record(StepShape.decode(4, 400), 0.010, False, 1, 0.0, 0, 0, True, gpu_time_s=0.012)
        block.publish(Side.DECODE, num_seqs=4, num_tokens=4, num_context_tokens=400, step_time_us=12_000,
                      num_queued=0, split_index=1)
        recorder.after_publish()
        assert observed == [(partitioner.ladder[1].decode_sms, 1)]
        _, entries = block.recent_steps(Side.DECODE, 0)
        assert entries == [(12_000, 10_000, 1)]
        assert block.rows[int(Side.DECODE)][Field.SPLIT_INDEX] == 1
    finally:
        block.close()


def test_split_switch_setting_is_checked_and_passed_through():
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError
    from bullet_ray.serve.config import EngineArgs

    assert EngineConfig().split_switch == "disjoint"
    assert EngineArgs(split_switch="overlap").to_engine_config().split_switch == "overlap"
    with pytest.raises(ConfigError, match="split_switch.*'sideways'"):
        EngineConfig(split_switch="sideways")
    with pytest.raises(ValueError, match="split_switch"):
        EngineArgs(split_switch="sideways")
