"""The opt-in TTFT planning margin (EngineConfig.ttft_margin_ms, SloTargets.margin_s) on fake queues: the policy
plans for target - margin, the SLO metrics keep the real target, and margin 0 changes nothing; with
ttft_margin_scope "order" only the order and the batches' fit plan with it, the split rule with the real targets."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import yaml
from pydantic import ValidationError

from bullet_ray.config import EngineConfig
from bullet_ray.engine.worker.policy_link import SplitDecider, with_pushed
from bullet_ray.errors import ConfigError
from bullet_ray.metrics import EngineMetrics
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.roofline import H100_SXM
from bullet_ray.policy.ordering import least_slack_order
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.split import SplitRule
from bullet_ray.policy.state import DecodeLoad, QueuedRequest, SplitReason
from bullet_ray.serve.config import EngineArgs
from tests.unit.test_policy import LADDER, LLAMA8B, _decide, _req, _state


def _own(r: QueuedRequest) -> float:
    return r.num_prompt_tokens * 1e-4  # 1,000 tokens: 100 ms


def _ids(order: list[QueuedRequest]) -> list[str]:
    return [r.request_id for r in order]


def test_a_request_inside_the_margin_is_lost_and_one_under_it_is_served_as_before():
    # served first, X would see 0.38 + 0.1 = 0.48 s (inside [0.45, 0.5]), Z 0.3 + 0.01 = 0.31 s, Y 0.1 s;
    # Z, shorter, moves ahead of X (X still makes 0.49 s), and Y follows
    x, y, z = _req("X", 1000, 0.38), _req("Y", 1000, 0.0), _req("Z", 100, 0.3)
    assert _ids(least_slack_order([x, y, z], _own, SloTargets(0.5))) == ["Z", "X", "Y"]
    # a 50 ms margin: X cannot make 0.45 s and goes to the back; Z (0.31 s < 0.45 s) and Y keep their order
    assert _ids(least_slack_order([x, y, z], _own, SloTargets(0.5, margin_s=0.05))) == ["Z", "Y", "X"]


def test_margin_zero_orders_a_random_queue_as_before_and_a_margin_is_a_shorter_target():
    rng = random.Random(7)
    for _ in range(50):
        queue = [QueuedRequest(f"r{i}", rng.randint(16, 4000), rng.uniform(0.0, 0.6)) for i in range(20)]
        start = rng.uniform(0.0, 0.1)
        before = _ids(least_slack_order(queue, _own, SloTargets(0.5), start))
        assert _ids(least_slack_order(queue, _own, EngineConfig().planning_targets(), start)) == before
        assert _ids(least_slack_order(queue, _own, SloTargets(0.5, margin_s=0.0), start)) == before
        assert _ids(least_slack_order(queue, _own, SloTargets(0.5, margin_s=0.07), start)) == \
            _ids(least_slack_order(queue, _own, SloTargets(0.43), start))


def _rule(margin_ms: float) -> SplitRule:
    return SplitRule(PerfModel(LLAMA8B, H100_SXM), LADDER, 132, SloTargets(0.5, 0.025, margin_s=margin_ms / 1e3))


def test_the_split_rule_judges_ttft_risk_against_the_planned_target():
    # 2,048 tokens after 0.42 s: 0.494 s on 68 prefill SMs (entry 6), 0.4635 s alone on 116
    state = _state(6, [_req("a", 2048, 0.42)])
    assert _decide(_rule(0), state).num_ttft_at_risk == 0  # 0.494 <= 0.5: holds
    d = _decide(_rule(20), state)  # 0.494 > 0.48 but 0.4635 <= 0.48: at risk, and it can still make it
    assert d.index == 0 and _rule(20).ttft_outlook(state, [list(state.queue)], 6, True, {"a"})[0] == 1
    # after 0.45 s: 0.4935 s alone meets 0.5 (to prefill) but not 0.49: backlog
    late = _state(6, [_req("a", 2048, 0.45)])
    assert _rule(0).num_late(late, True) == 0 and _rule(10).num_late(late, True) == 1
    assert _rule(10).feasible(late, [list(late.queue)], True) == set()
    # after 0.40 s (0.474 s on entry 6, under 0.48): the same decision as without a margin
    early = _state(6, [_req("a", 2048, 0.40)])
    with_margin, without = _decide(_rule(20), early), _decide(_rule(0), early)
    assert (with_margin.index, with_margin.reason, with_margin.num_ttft_at_risk) == \
        (without.index, without.reason, without.num_ttft_at_risk)
    assert with_margin.worst_ttft_slack_s == pytest.approx(without.worst_ttft_slack_s - 0.02)  # reported as planned


def test_the_margin_stays_on_pushed_targets_and_never_takes_the_whole_target():
    planned = EngineConfig(ttft_margin_ms=50.0).planning_targets()
    assert planned.ttft_target_s(100) == pytest.approx(0.45)
    pushed = with_pushed(planned, (1.0, 0.05))
    assert pushed.margin_s == 0.05 and pushed.ttft_target_s(100) == pytest.approx(0.95)
    assert with_pushed(planned, (0.04, 0.05)).ttft_target_s(100) == pytest.approx(0.004)  # a tenth, not <= 0
    per_token = SloTargets(0.5, 0.025, ttft_per_token_s=0.003, margin_s=0.05)
    assert per_token.ttft_target_s(1000) == pytest.approx(2.95)  # the margin comes off the per-token target too


def test_slo_metrics_keep_the_real_target():
    cfg = EngineConfig(ttft_margin_ms=50.0)
    real = cfg.slo_targets()  # what the Serve replica builds its metrics from
    assert real.margin_s == 0.0 and real == EngineConfig().slo_targets()
    metrics = EngineMetrics("m", "e", ttft_target_s=real.ttft_s, tpot_target_s=real.tpot_s,
                            ttft_per_token_s=real.ttft_per_token_s)
    assert metrics.meets_slo(0.48, 0.48 + 10 * 0.02, 11)  # inside the margin: still meets 0.5 s
    assert not metrics.meets_slo(0.51, 0.51 + 10 * 0.02, 11)


@pytest.mark.parametrize(("target_ms", "margin_ms", "message"), [
    (500.0, -1.0, "must be >= 0 and finite"), (500.0, float("nan"), "must be >= 0 and finite"),
    (500.0, float("inf"), "must be >= 0 and finite"), (500.0, 500.0, "must be < ttft_target_ms"),
    (500.0, 600.0, "must be < ttft_target_ms"), (100.0, 150.0, "must be < ttft_target_ms")])
def test_bad_margins_name_the_field(target_ms: float, margin_ms: float, message: str):
    with pytest.raises(ConfigError, match=f"^ttft_margin_ms: {message}"):
        EngineConfig(ttft_target_ms=target_ms, ttft_margin_ms=margin_ms)


def test_a_margin_may_exceed_the_floor_of_per_prompt_token_targets():
    # Bullet's ShareGPT preset: 3 ms per prompt token, the floor one token's worth; a 25 ms margin is allowed and
    # a 1,000-token prompt is planned for 3 s - 25 ms, a 2-token one for a tenth of its 6 ms
    cfg = EngineConfig(ttft_target_ms=3.0, ttft_target_ms_per_prompt_token=3.0, ttft_margin_ms=25.0)
    planned = cfg.planning_targets()
    assert planned.ttft_target_s(1000) == pytest.approx(2.975)
    assert planned.ttft_target_s(2) == pytest.approx(0.0006)
    assert cfg.slo_targets().ttft_target_s(1000) == pytest.approx(3.0)


def test_bad_margins_at_the_yaml_edge_name_the_field():
    with pytest.raises(ValidationError, match="ttft_margin_ms"):
        EngineArgs(ttft_margin_ms=-1.0)
    with pytest.raises(ConfigError, match="ttft_margin_ms"):
        EngineArgs(ttft_margin_ms=500.0).to_engine_config()  # the bound on the target is EngineConfig's
    with pytest.raises(ConfigError, match="ttft_margin_ms"):
        SloTargets(0.5, margin_s=-0.001)
    assert EngineArgs(ttft_margin_ms=25.0).to_engine_config().planning_targets().margin_s == 0.025


# ttft_margin_scope: "all" plans the order, the batches' fit and the split rule with the margin; "order" leaves the
# split rule the real targets


def _decider(cfg: EngineConfig, state: object = None) -> SplitDecider:
    """The prefill worker's SplitDecider as the worker builds it from `cfg`, on fakes (no GPU, no workers)."""
    ladder = [SimpleNamespace(decode_sms=d, prefill_sms=132 - d) for d in LADDER]
    worker = SimpleNamespace(config=cfg, partitioner=SimpleNamespace(ladder=ladder, whole_index=None),
                             res=SimpleNamespace(state=state))
    return SplitDecider(worker, PerfModel(LLAMA8B, H100_SXM), SimpleNamespace())  # type: ignore[arg-type]


def test_scope_order_gives_the_split_rule_the_real_targets_and_the_order_the_margin():
    both = _decider(EngineConfig(ttft_margin_ms=20.0)).policy
    order_only = _decider(EngineConfig(ttft_margin_ms=20.0, ttft_margin_scope="order")).policy
    assert both.targets.margin_s == both.rule.targets.margin_s == 0.02
    assert order_only.targets.margin_s == 0.02 and order_only.rule.targets == SloTargets(0.5, 0.025)
    # the order: X (2,048 tokens, 74 ms on entry 6's prefill SMs) would finish at 0.49 s, inside the margin, so
    # the margin sends it behind Y under either scope
    x, y = _req("X", 2048, 0.416), _req("Y", 2048, 0.0)
    state = _state(6, [x, y])
    assert _ids(order_only.plan(state, 6)[0]) == _ids(both.plan(state, 6)[0]) == ["Y", "X"]
    assert _ids(_decider(EngineConfig()).policy.plan(state, 6)[0]) == ["X", "Y"]


@pytest.mark.parametrize(("decode", "with_margin", "without"), [
    # decode 20.6 ms on entry 6 (inside its band): the margin sees "a" at risk and squeezes decode to 24.1 ms
    (DecodeLoad(128, 128 * 2048), (3, SplitReason.TO_PREFILL), (6, SplitReason.HOLD)),
    # decode 28.9 ms, over its 25 ms target: the margin balances at 26.9 ms, the real target gives decode its SMs
    (DecodeLoad(192, 192 * 2048), (8, SplitReason.BALANCE), (12, SplitReason.TO_DECODE)),
])
def test_a_request_inside_the_margin_moves_the_split_only_with_scope_all(decode, with_margin, without):
    # 2,048 tokens after 0.42 s: 0.494 s on entry 6, over 0.48 s planned, under the real 0.5 s
    state = _state(6, [_req("a", 2048, 0.42)], decode=decode)
    decided = {scope: _decider(EngineConfig(ttft_margin_ms=20.0, ttft_margin_scope=scope)).policy.step(state).split
               for scope in ("all", "order")}
    assert (decided["all"].index, decided["all"].reason) == with_margin
    assert (decided["order"].index, decided["order"].reason) == without
    plain = _decider(EngineConfig()).policy.step(state).split  # no margin at all: what "order" decides
    assert (plain.index, plain.reason) == without


@pytest.mark.parametrize("scope", ["all", "order"])
def test_pushed_targets_reach_the_order_and_the_split_rule_each_with_its_margin(tmp_path, scope: str):
    from bullet_ray.engine.state_block import StateBlock

    block = StateBlock.create(str(tmp_path / "state"))
    try:
        decider = _decider(EngineConfig(ttft_margin_ms=20.0, ttft_margin_scope=scope), block)
        block.set_slo_targets(1.0, 0.05)
        decider._follow_pushed_targets()
        policy = decider.policy
        assert policy.targets == SloTargets(1.0, 0.05, margin_s=0.02)
        assert policy.rule.targets == SloTargets(1.0, 0.05, margin_s=0.02 if scope == "all" else 0.0)
        assert policy.rule.targets.ttft_target_s(100) == pytest.approx(0.98 if scope == "all" else 1.0)
    finally:
        block.close()


def test_a_bad_margin_scope_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"^ttft_margin_scope: unknown margin scope 'split'; choose all .* or order"):
        EngineConfig(ttft_margin_ms=20.0, ttft_margin_scope="split")
    with pytest.raises(ValidationError, match="ttft_margin_scope"):
        EngineArgs(ttft_margin_scope="split")
    cfg = EngineConfig(ttft_margin_ms=20.0)
    assert cfg.ttft_margin_scope == "all" and cfg.split_targets() == cfg.planning_targets()  # the default: as measured


def test_the_margin_scope_round_trips_through_the_yaml_edge():
    from bullet_ray.serve.config import BulletAppConfig

    text = yaml.safe_dump({"engine": {"ttft_margin_ms": 25.0, "ttft_margin_scope": "order"}})
    args = BulletAppConfig(**yaml.safe_load(text)).engine
    assert EngineArgs(**yaml.safe_load(yaml.safe_dump(args.model_dump()))) == args
    cfg = args.to_engine_config()
    assert (cfg.ttft_margin_ms, cfg.ttft_margin_scope) == (25.0, "order")
    assert cfg.planning_targets().margin_s == 0.025 and cfg.split_targets() == cfg.slo_targets()
    assert EngineArgs().to_engine_config().ttft_margin_scope == "all"


def test_fallback_target_from_the_config_survives_a_push_only_while_it_is_later():
    cfg = EngineConfig(ttft_target_ms=500, ttft_fallback_ms=1000, ttft_margin_ms=50)
    planned = cfg.planning_targets()
    assert planned.fallback_target_s(100) == pytest.approx(0.95)
    assert with_pushed(planned, (0.6, 0.025)).fallback_ttft_s == pytest.approx(1.0)
    assert with_pushed(planned, (1.0, 0.05)).fallback_ttft_s is None  # a pushed relaxed target: no fallback left
    with pytest.raises(ConfigError, match="ttft_fallback_ms"):
        EngineConfig(ttft_target_ms=500, ttft_fallback_ms=400)
    with pytest.raises(ValueError, match="ttft_fallback_ms"):
        EngineArgs(ttft_fallback_ms=-1)
    assert EngineArgs(ttft_fallback_ms=1000).to_engine_config().ttft_fallback_ms == 1000
