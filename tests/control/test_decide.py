"""The controller's pure decision on made-up readings (no Ray)."""

from __future__ import annotations

from bullet_ray.control.config import ControllerConfig
from bullet_ray.control.decide import ControllerInputs, ControllerState, Decision, EngineObservation, decide
from bullet_ray.control.forecast import LoadForecast, LoadSample

# 100 tokens per request: 1 req/s = 100 tok/s; one engine serves 1000 tok/s, aimed at 80%
CFG = ControllerConfig(engine_capacity_tokens_s=1000.0, target_utilization=0.8, max_engines=4, scale_down_after=3,
                       ttft_target_ms=500.0, tpot_target_ms=25.0, min_decode_sms=16, max_decode_sms=112)


def inputs(rate: float, forecast_rate: float, replicas: int = 1, engines: tuple = ()) -> ControllerInputs:
    return ControllerInputs(100.0, engines, LoadSample(rate, 80.0, 20.0), LoadForecast(30.0, forecast_rate, 80.0, 20.0),
                            replicas, max_engines=4)


def test_forecast_scales_up_before_the_load_arrives():
    d, s = decide(inputs(rate=5.0, forecast_rate=5.0), CFG, ControllerState())
    assert d.num_replicas == 1 and d.mode == "queue"  # 500 tok/s fits one engine at 80%
    d, s = decide(inputs(rate=5.0, forecast_rate=12.0), CFG, s)  # measured still fits; the forecast does not
    assert d.num_replicas == 2
    assert d.reasons[0].startswith("scale up 1->2")
    assert (d.seq, s.seq) == (2, 2)


def test_scale_down_waits_and_budget_caps_and_sheds():
    s = ControllerState()
    for i in range(2):
        d, s = decide(inputs(rate=1.0, forecast_rate=1.0, replicas=3), CFG, s)
        assert d.num_replicas == 3 and s.num_low_decisions == i + 1
    d, s = decide(inputs(rate=1.0, forecast_rate=1.0, replicas=3), CFG, s)
    assert d.num_replicas == 1 and s.num_low_decisions == 0
    d, _ = decide(inputs(rate=50.0, forecast_rate=60.0), CFG, s)  # 6000 tok/s > budget 4 x 1000
    assert d.num_replicas == 4 and d.mode == "shed"
    assert d.default.max_waiting_per_engine == CFG.shed_max_waiting and d.default.admission_ttft_s == 0.5


def test_split_bounds_follow_the_missed_target():
    engines = (EngineObservation("a", decode_sms=64, tpot_p90_s=0.040, ttft_p90_s=0.1),   # decode too slow
               EngineObservation("b", decode_sms=64, tpot_p90_s=0.010, ttft_p90_s=0.9),   # prompts wait
               EngineObservation("c", decode_sms=64, tpot_p90_s=0.010, ttft_p90_s=0.1))   # fine
    d, _ = decide(inputs(1.0, 1.0, engines=engines), CFG, ControllerState())
    a, b, c = (d.for_engine(x) for x in "abc")
    assert (a.min_decode_sms, a.max_decode_sms) == (72, 112)
    assert (b.min_decode_sms, b.max_decode_sms) == (16, 56)
    assert (c.min_decode_sms, c.max_decode_sms) == (16, 112)
    assert c.ttft_target_ms == 500.0 and c.tpot_target_ms == 25.0 and c.max_waiting_per_engine is None
    assert d.for_engine("unknown") == d.default


def test_operator_ceiling_caps_every_engine_and_decision_round_trips():
    cfg = CFG.model_copy(update={"max_decode_sms": 24})
    d, _ = decide(inputs(1.0, 1.0, engines=(EngineObservation("a", decode_sms=64),)), cfg, ControllerState())
    assert d.for_engine("a").max_decode_sms == 24 and d.default.max_decode_sms == 24
    assert Decision.from_dict(d.to_dict()) == d


def test_split_bounds_stay_inside_the_operators_range_wherever_the_engine_runs_now():
    """Operator range [40, 64]; an engine still outside it (before the first push, or after the operator tightened
    it): the bound moved from where it runs never leaves the range."""
    cfg = CFG.model_copy(update={"min_decode_sms": 40, "max_decode_sms": 64})
    engines = (EngineObservation("wide", decode_sms=100, tpot_p90_s=0.010, ttft_p90_s=0.9),   # TTFT over: shrink
               EngineObservation("narrow", decode_sms=16, tpot_p90_s=0.040, ttft_p90_s=0.1))  # TPOT over: grow
    d, _ = decide(inputs(1.0, 1.0, engines=engines), cfg, ControllerState())
    wide, narrow = d.for_engine("wide"), d.for_engine("narrow")
    assert (wide.min_decode_sms, wide.max_decode_sms) == (40, 64)  # not [40, 92]
    assert (narrow.min_decode_sms, narrow.max_decode_sms) == (40, 64)  # not [24, 64]
    for e in (wide, narrow):
        assert 40 <= e.min_decode_sms <= e.max_decode_sms <= 64


def test_admission_leaves_shed_only_with_a_margin():
    """Budget 4 x 1000 tok/s; demand at 4,100 sheds, 3,900 (under the budget, over 90% of it) still sheds, 3,500
    queues: demand hovering at the budget does not flip the engines' admission every interval."""
    s = ControllerState()
    modes = []
    for rate in (41.0, 39.0, 35.0, 39.0):  # x 100 tokens per request
        d, s = decide(inputs(rate, rate, replicas=4), CFG, s)
        modes.append(d.mode)
    assert modes == ["shed", "shed", "queue", "queue"]
    assert ControllerState(**{"seq": 3, "num_low_decisions": 0}).is_shedding is False  # an older saved state
