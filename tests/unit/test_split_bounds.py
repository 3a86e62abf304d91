"""The engine front's split controls on a fake front (no workers): a manual split request must name a ladder
entry (one past the ladder would never be acked, and no later request could settle), and the cluster
controller's bounds never leave the policy only the mixed fallback's whole-GPU entry (prefill would starve)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.errors import InvalidRequest
from bullet_ray.gpu.partition import default_ladder


def _front(mixed: bool) -> SimpleNamespace:
    ladder = default_ladder(132) + ([132] if mixed else [])  # 16, 24, ..., 112 (+ the whole GPU)
    bounds: list[tuple[int, int]] = []
    timed: list[int] = []  # switches the front asked the state block for, by entry

    def request_switch(index: int) -> None:
        timed.append(index)
        state.switch[0] = index

    state = SimpleNamespace(set_split_bounds=lambda lo, hi: bounds.append((lo, hi)), switch=[0, 0, 0, 0],
                            request_switch=request_switch)
    front = SimpleNamespace(ladder_decode_sms=ladder, sm_count=132, state=state, bounds=bounds, timed=timed,
                            config=SimpleNamespace(is_disaggregated=False), num_split_requests=0,
                            _wake_workers=lambda: None, worker_info={})
    front.split_ladder_size = lambda: LLMEngine.split_ladder_size(front)
    front.split_indexes = lambda: LLMEngine.split_indexes(front)
    return front


@pytest.mark.parametrize("index", [-1, 13, 14])
def test_a_split_request_outside_the_ladder_is_refused(index):
    front = _front(mixed=True)  # 14 entries: 0..13, the last the whole GPU
    if index == 13:
        LLMEngine.request_split(front, index)  # the whole-GPU entry is a ladder entry: allowed by hand
        assert front.state.switch[0] == 13 and front.num_split_requests == 1
        assert front.timed == [13]
        return
    with pytest.raises(InvalidRequest, match="split index") as e:
        LLMEngine.request_split(front, index)
    assert e.value.field == "split_index" and front.num_split_requests == 0


@pytest.mark.parametrize("mixed", [False, True])
def test_bounds_that_hold_only_the_whole_gpu_keep_the_nearest_ordinary_entry(mixed):
    front = _front(mixed)
    top = len(default_ladder(132)) - 1  # 112 decode SMs
    assert LLMEngine.set_split_bounds(front, 120, None) == (top, top)
    assert LLMEngine.set_split_bounds(front, 24, 40) == (1, 3)
    # no upper bound: the whole-GPU entry stays allowed beside ordinary ones (the fallback may still use it)
    assert LLMEngine.set_split_bounds(front, 100, None) == (top - 1, top + 1 if mixed else top)
    assert front.bounds[-1] == (top - 1, top + 1 if mixed else top)


def test_a_split_request_names_an_entry_of_every_workers_ladder():
    """The workers report their ladders' sizes; the mps backend's has one entry (its split is fixed by
    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE), so no other index could ever be acked."""
    front = _front(mixed=False)
    assert LLMEngine.split_ladder_size(front) == len(front.ladder_decode_sms)  # before the workers said
    front.worker_info = {"prefill": {"ladder_size": 1}, "decode": {"ladder_size": 1}}
    with pytest.raises(InvalidRequest, match=r"outside the ladder \[0, 0\]"):
        LLMEngine.request_split(front, 1)
    LLMEngine.request_split(front, 0)
    assert front.num_split_requests == 1 and front.timed == [0]
    # the controller's bounds on this front's longer ladder never name an entry past the workers' one
    assert LLMEngine.set_split_bounds(front, 64, None) == (0, 0)
    assert front.bounds[-1] == (0, 0)



def test_the_front_takes_the_ladder_the_decode_worker_granted():
    """The front's ladder is the decode worker's report (a green partition rounds 12 up to 16; the mixed fallback's
    whole-GPU entry is in it), not the configured counts; without a decode worker (chunked) the configured or default
    ladder, with the whole-GPU entry when the mixed fallback is on."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import workers_ladder

    asked = EngineConfig(model="dummy:tiny-llama", decode_sm_counts=[12, 64])
    assert workers_ladder({"decode": {"ladder_decode_sms": [16, 64, 132]}}, asked, 132) == [16, 64, 132]
    assert workers_ladder({"hybrid": {}}, asked, 132) == [12, 64]
    assert workers_ladder({}, EngineConfig(model="dummy:tiny-llama"), 132) == default_ladder(132)
    mixed = EngineConfig(model="dummy:tiny-llama", split_policy="slo", mixed_fallback_tokens=64)
    assert workers_ladder({}, mixed, 132) == default_ladder(132) + [132]
