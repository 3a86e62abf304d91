"""How an engine replica takes a decision, and the autoscaling policy that follows the controller (no Ray)."""

from __future__ import annotations

import types

from bullet_ray.control import autoscale
from bullet_ray.control.apply import apply_decision, reconfigure_admission
from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.decide import ControllerInputs, ControllerState, EngineObservation, decide
from bullet_ray.control.forecast import LoadForecast, LoadSample
from bullet_ray.metrics import EngineMetrics
from bullet_ray.serve.admission import AdmissionSettings


class FakeEngine:
    """The part of LLMEngine a decision touches."""

    def __init__(self) -> None:
        self.ladder_decode_sms = [16, 24, 32, 40, 48]
        self.bounds: tuple[int | None, int | None] | None = None

    def set_split_bounds(self, lo: int | None, hi: int | None) -> tuple[int, int]:
        self.bounds = (lo, hi)
        inside = [i for i, c in enumerate(self.ladder_decode_sms) if (lo is None or c >= lo) and (hi is None or c <= hi)]
        return inside[0], inside[-1]


def replica(engine) -> types.SimpleNamespace:
    return types.SimpleNamespace(replica_id="r1", engine=engine, admission=AdmissionSettings(64),
                                 metrics=EngineMetrics("m", "r1"))


def decision(rate: float, **cfg) -> dict:
    config = ControllerConfig(engine_capacity_tokens_s=100.0, max_engines=1, ttft_target_ms=800.0,
                              tpot_target_ms=40.0, **cfg)
    inputs = ControllerInputs(0.0, (EngineObservation("r1", decode_sms=40),), LoadSample(rate, 10.0, 10.0),
                              LoadForecast(10.0, rate, 10.0, 10.0), 1, 1)
    return decide(inputs, config, ControllerState())[0].to_dict()


def test_bounds_targets_and_admission_reach_the_engine_and_shedding_is_undone():
    r = replica(FakeEngine())
    out = apply_decision(r, decision(rate=1.0, max_decode_sms=32))
    assert r.engine.bounds == (None, 32) and out["decode_sms_bounds"] == (16, 32)
    assert r.metrics.tpot_target_s == 0.040 and r.metrics.ttft_target_s == 0.8
    assert r.admission.max_waiting_per_engine == 64
    apply_decision(r, decision(rate=20.0, shed_max_waiting=4))  # 400 tok/s > the budget of 100: shed
    assert r.admission.max_waiting_per_engine == 4 and r.admission.admission_ttft_s == 0.8
    apply_decision(r, decision(rate=1.0))
    assert r.admission == AdmissionSettings(64)


def test_an_operators_runtime_admission_change_outlives_the_controllers_decisions():
    r = replica(FakeEngine())
    apply_decision(r, decision(rate=1.0))
    reconfigure_admission(r, {"admission_ttft_ms_per_prompt_token": 1.5, "max_waiting_per_engine": 32})
    assert r.admission.admission_ttft_ms_per_prompt_token == 1.5
    apply_decision(r, decision(rate=20.0, shed_max_waiting=4))  # shedding overrides the queue, keeps the rest
    assert r.admission.max_waiting_per_engine == 4 and r.admission.admission_ttft_ms_per_prompt_token == 1.5
    apply_decision(r, decision(rate=1.0))  # back to the operator's settings, not the ones before the change
    assert r.admission == AdmissionSettings(32, admission_ttft_ms_per_prompt_token=1.5)


def test_engines_without_a_split_and_other_nodes_decisions():
    r = replica(types.SimpleNamespace())  # the mock engine: no SM split
    assert apply_decision(r, decision(rate=1.0))["decode_sms_bounds"] is None
    assert apply_decision(r, {**decision(rate=1.0), "node_id": "another-node"}) == {"skipped": True}


def test_autoscaling_policy_follows_the_controller_within_serve_bounds(monkeypatch):
    ctx = types.SimpleNamespace(app_name="a", target_num_replicas=1, policy_state={}, capacity_adjusted_min_replicas=1,
                                capacity_adjusted_max_replicas=2)
    monkeypatch.setattr(autoscale, "kv_get", lambda app, what: None)
    assert autoscale.follow_controller(ctx) == (1, {})  # no decision yet: hold
    monkeypatch.setattr(autoscale, "kv_get", lambda app, what: 5)
    assert autoscale.follow_controller(ctx) == (2, {"controller_num_replicas": 5})
    cfg = autoscale.autoscaling_config(1, 2, 1)
    assert cfg["policy"]["policy_function"] == autoscale.POLICY_PATH and cfg["max_replicas"] == 2
