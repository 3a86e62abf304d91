"""The per-step scheduler on crafted states: every branch of the split rule, hysteresis, least-slack
ordering, length buckets and prefill batches (H100 + Llama-3.1-8B roofline, no calibration; ms each)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.gpu.partition import default_ladder
from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.roofline import H100_SXM
from bullet_ray.policy.batching import plan_batches
from bullet_ray.policy.buckets import LengthBuckets
from bullet_ray.policy.bullet import BulletPolicy
from bullet_ray.policy.ordering import least_slack_order, most_on_time, most_within_fallback
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.split import SplitRule, SplitSettings
from bullet_ray.policy.state import DecodeLoad, QueuedRequest, SplitReason, StepState

PRESETS = Path(__file__).resolve().parents[2] / "bullet_ray" / "models" / "presets"
LLAMA8B = ModelConfig.from_hf_dict(json.loads((PRESETS / "llama-3.1-8b.json").read_text()))
LADDER = default_ladder(132)  # 16, 24, ..., 112 decode SMs
BUSY = DecodeLoad(64, 64 * 1024)  # decode steps: 18.5 ms on 16 SMs, 14.1 on 24, 12.2 on 32 ... 9.25 on 112


def _rule(tpot_ms: float = 25.0, ttft_ms: float = 500.0, **settings) -> SplitRule:
    return SplitRule(PerfModel(LLAMA8B, H100_SXM), LADDER, 132, SloTargets(ttft_ms / 1e3, tpot_ms / 1e3),
                     SplitSettings(**settings))


def _req(rid: str, tokens: int, waited_s: float = 0.0) -> QueuedRequest:
    return QueuedRequest(rid, tokens, waited_s)


def _state(index: int, queue=(), decode=BUSY, now_s: float = 1.0) -> StepState:
    return StepState(index, tuple(queue), decode, now_s)


def _decide(rule: SplitRule, state: StepState):
    return rule.decide(state, [[r] for r in state.queue])


def test_decode_steps_follow_the_ladder():
    rule = _rule()
    steps = [rule.decode_step_s(_state(0), i) * 1e3 for i in range(len(LADDER))]
    assert steps == sorted(steps, reverse=True)
    assert steps[0] == pytest.approx(18.46, abs=0.05) and steps[-1] == pytest.approx(9.25, abs=0.05)


def test_idle_keeps_the_split():
    d = _decide(_rule(), _state(5, decode=DecodeLoad(0, 0)))
    assert (d.index, d.reason) == (5, SplitReason.IDLE)


def test_only_prefill_takes_the_most_prefill_sms():
    d = _decide(_rule(), _state(8, [_req("a", 1000)], decode=DecodeLoad(0, 0)))
    assert (d.index, d.reason) == (0, SplitReason.ONLY_PREFILL)


def test_only_decode_takes_the_sms_that_meet_its_aim():
    # 18.5 ms on 16 SMs (prefill busy) <= 0.85 x 25: a faster TPOT earns nothing, prefill keeps its share
    d = _decide(_rule(), _state(7))
    assert (d.index, d.reason) == (0, SplitReason.ONLY_DECODE)
    # TPOT 14 ms: the fewest SMs under 11.9 ms are 40 (11.1 ms; 32 SMs give 12.15)
    d = _decide(_rule(tpot_ms=14.0), _state(0))
    assert (d.index, d.reason) == (LADDER.index(40), SplitReason.ONLY_DECODE)
    # nothing meets the aim: the most
    d = _decide(_rule(tpot_ms=8.0), _state(0))
    assert (d.index, d.reason) == (len(LADDER) - 1, SplitReason.ONLY_DECODE)


def test_only_decode_fastest_takes_the_sms_that_still_speed_it_up():
    d = _decide(_rule(idle_decode="fastest"), _state(0))
    # fastest 9.25 ms on 112 SMs; 72 SMs (9.68 ms) is the first within 5%
    assert (d.index, d.reason) == (LADDER.index(72), SplitReason.ONLY_DECODE)


def test_without_the_backlog_rule_late_requests_leave_decode_at_its_aim():
    d = _decide(_rule(tpot_ms=20.0, backlog_aim=None), _state(1, [_req("a", 512), _req("late", 512, 3.0)]))
    assert (d.index, d.reason) == (1, SplitReason.HOLD)


def test_tpot_slack_gives_sms_to_prefill_gradually():
    # 9.9 ms on 64 SMs is under 0.6 x 25 ms: decode could run on 16 SMs (18.5 ms <= 0.85 x 25) but gives up two entries
    d = _decide(_rule(), _state(6, [_req("a", 512)]))
    assert (d.index, d.reason) == (4, SplitReason.TO_PREFILL)
    assert d.num_ttft_at_risk == 0


def test_inside_the_band_the_split_holds():
    d = _decide(_rule(tpot_ms=20.0), _state(1, [_req("a", 512)]))  # 14.1 ms in [12, 17]
    assert (d.index, d.reason) == (1, SplitReason.HOLD)


def test_tpot_over_its_aim_gives_sms_to_decode_at_once():
    d = _decide(_rule(tpot_ms=20.0), _state(0, [_req("a", 512)]))  # 18.5 ms > 17: 24 SMs give 14.1
    assert (d.index, d.reason) == (1, SplitReason.TO_DECODE)
    d = _decide(_rule(tpot_ms=8.0), _state(3, [_req("a", 512)]))  # nothing meets 6.8 ms: the most
    assert (d.index, d.reason) == (len(LADDER) - 1, SplitReason.TO_DECODE)


def test_ttft_at_risk_spends_all_decode_slack_on_prefill():
    # 2048 tokens after 0.45 s: 74 ms on 68 prefill SMs misses 0.5 s, 43.5 ms on 116 makes it
    d = _decide(_rule(), _state(6, [_req("a", 2048, 0.45)]))
    assert (d.index, d.reason) == (0, SplitReason.TO_PREFILL)  # 18.5 ms <= 25: no gradual limit
    assert d.num_ttft_at_risk == 0


def test_ttft_at_risk_and_tpot_over_balances():
    # TPOT 12 ms: 14.1 ms on 24 SMs is over; the request misses on 108 prefill SMs but not on 116
    d = _decide(_rule(tpot_ms=12.0), _state(1, [_req("a", 2048, 0.455)]))
    assert d.reason is SplitReason.BALANCE
    assert d.index == LADDER.index(32)  # max(12.15 / 12, 0.5054 / 0.5) = 1.0125 is the lowest


def test_tpot_first_balance_keeps_decode_at_its_target():
    """balance "tpot_first": TTFT at risk and decode over its target: decode gets the fewest SMs whose step meets the
    TPOT target (minimax gave it fewer, over the target); where no entry meets it, the minimax as before."""
    state = _state(1, [_req("a", 2048, 0.455)])  # TPOT 12 ms: 14.1 ms on 24 SMs is over
    minimax = _decide(_rule(tpot_ms=12.0), state)
    first = _decide(_rule(tpot_ms=12.0, balance="tpot_first"), state)
    assert (minimax.reason, first.reason) == (SplitReason.BALANCE, SplitReason.BALANCE_TPOT)
    steps = [_rule(tpot_ms=12.0).decode_step_s(state, i) for i in range(len(LADDER))]
    assert first.index == next(i for i, t in enumerate(steps) if t <= 0.012) > minimax.index
    assert steps[first.index] <= 0.012 < steps[minimax.index]
    # the model says the current entry meets the target but decode's measured step does not: one entry more
    fit = first.index
    measured_over = _state(fit, [_req("a", 2048, 0.455)], DecodeLoad(BUSY.num_seqs, BUSY.num_context_tokens, 0.0125))
    up = _decide(_rule(tpot_ms=12.0, balance="tpot_first"), measured_over)
    assert (up.index, up.reason) == (fit + 1, SplitReason.BALANCE_TPOT)
    never = _decide(_rule(tpot_ms=5.0, balance="tpot_first"), state)  # no entry meets 5 ms
    assert never.index == _decide(_rule(tpot_ms=5.0), state).index
    with pytest.raises(ConfigError, match="split.balance"):
        SplitSettings(balance="fair")
    with pytest.raises(ConfigError, match="split.max_shrink"):
        SplitSettings(max_shrink=True)


def test_a_request_that_cannot_make_it_is_backlog_not_at_risk():
    d = _decide(_rule(), _state(6, [_req("a", 2048, 0.499)]))
    # not "at risk" (nothing can save it), but backlog: decode keeps only what holds 0.95 x TPOT, two entries a time
    assert d.reason is SplitReason.BACKLOG and d.num_ttft_at_risk == 0
    assert d.index == 4


def test_backlog_spends_decode_slack_down_to_the_backlog_aim():
    # TPOT 20 ms: 24 SMs (14.1 ms) is inside the ordinary band [12, 17] and would hold; with a late request
    # decode goes to the fewest SMs under 0.95 x 20 = 19 ms: 16 SMs (18.5 ms), at once (no dwell)
    rule = _rule(tpot_ms=20.0, min_dwell_s=10.0)
    assert _decide(rule, _state(1, [_req("a", 512)])).reason is SplitReason.HOLD
    d = _decide(rule, _state(1, [_req("a", 512), _req("late", 512, 3.0)]))
    assert (d.index, d.reason) == (0, SplitReason.BACKLOG)
    # decode over the backlog aim takes SMs back: TPOT 16 ms -> the fewest under 15.2 ms is 24 SMs (14.1)
    d = _decide(_rule(tpot_ms=16.0), _state(0, [_req("late", 512, 3.0)]))
    assert (d.index, d.reason) == (1, SplitReason.BACKLOG)


def test_backlog_counts_requests_past_the_planned_batches():
    # the late request is ordered last, past the policy's lookahead; the rule still sees it
    rule = _rule(tpot_ms=20.0)
    queue = [_req(f"r{i}", 256) for i in range(3)] + [_req("late", 256, 3.0)]
    state = _state(1, queue)
    assert rule.num_late(state, True) == 1
    assert rule.decide(state, [[queue[0]]]).reason is SplitReason.BACKLOG


def test_ordinary_moves_wait_for_the_dwell_time():
    rule = _rule(tpot_ms=20.0, min_dwell_s=0.05)
    assert _decide(rule, _state(0, [_req("a", 512)], now_s=1.0)).index == 1  # moved at 1.0
    d = _decide(rule, _state(6, [_req("a", 512)], now_s=1.02))  # 9.9 ms < 12 wants prefill, too soon
    assert (d.index, d.reason) == (6, SplitReason.HOLD)
    d = _decide(rule, _state(6, [_req("a", 512)], now_s=1.06))
    assert (d.index, d.reason) == (4, SplitReason.TO_PREFILL)
    # a burst (one side idle) moves at once
    assert _decide(rule, _state(6, [_req("a", 512)], decode=DecodeLoad(0, 0), now_s=1.03)).index == 0


def test_bad_ladders_and_settings_name_the_field():
    with pytest.raises(ConfigError, match="decode_sm_counts"):
        SplitRule(PerfModel(LLAMA8B, H100_SXM), [64, 16], 132, SloTargets())
    with pytest.raises(ConfigError, match="split.aim"):
        SplitSettings(aim=0.5, hold_below=0.6)
    with pytest.raises(ConfigError, match="split.backlog_aim"):
        SplitSettings(backlog_aim=0.8)
    with pytest.raises(ConfigError, match="split.idle_decode"):
        SplitSettings(idle_decode="slowest")
    with pytest.raises(ConfigError, match="split_index"):
        _rule().decide(_state(40), [])


def _own(r: QueuedRequest) -> float:
    return r.num_prompt_tokens * 1e-4


def test_least_slack_first_and_lost_requests_last():
    a, b, c, d = _req("A", 1000, 0.0), _req("B", 2000, 0.3), _req("C", 100, 0.1), _req("D", 500, 0.6)
    order = least_slack_order([a, b, c, d], _own, SloTargets(0.5))
    # slack: B 0.0, C 0.39, A 0.4; D cannot make it. C may not pass B (B would finish at 0.51 s)
    assert [r.request_id for r in order] == ["B", "C", "A", "D"]


def test_shorter_requests_move_forward_when_no_target_breaks():
    e, f = _req("E", 1000), _req("F", 100, 0.0)
    assert [r.request_id for r in least_slack_order([e, f], _own, SloTargets(0.5))] == ["F", "E"]
    # a prompt in progress stays first whatever its slack
    g = QueuedRequest("G", 4000, 0.0, num_computed_tokens=2048)
    assert least_slack_order([e, f, g], _own, SloTargets(0.5))[0].request_id == "G"


def test_per_token_ttft_targets():
    t = SloTargets(0.5, 0.025, ttft_per_token_s=0.003)
    assert t.ttft_target_s(100) == 0.5 and t.ttft_target_s(1000) == pytest.approx(3.0)


def test_buckets_split_when_crowded_and_merge_when_sparse():
    b = LengthBuckets((0, 256, 1024, 4096), split_above=4, merge_below=2, min_width=32)
    lengths = [300, 320, 340, 600, 700, 800, 900]
    assert b.rebalance(lengths)
    assert 600 in b.bounds  # the crowded [256, 1024) split at its median
    groups = b.group(lengths)
    assert [lengths[i] for i in groups[b.bucket_of(300)]] == [300, 320, 340]
    # the sparse ends merge: nothing below 256 and nothing above 1024 -> fewer buckets
    assert 4096 not in b.bounds
    b2 = LengthBuckets((0, 256, 1024, 4096), split_above=4, merge_below=2)
    assert b2.rebalance([5000]) and b2.bounds == [0]  # one prompt: one bucket
    with pytest.raises(ConfigError, match="bucket_bounds"):
        LengthBuckets((10, 5))


def test_batches_group_similar_lengths_up_to_saturation():
    buckets = LengthBuckets((0, 256, 1024, 4096))
    order = [_req("a", 300), _req("b", 3000), _req("c", 400), _req("d", 100), _req("e", 500)]
    batches = plan_batches(order, buckets, token_cap=8192, saturation_tokens=1300)
    ids = [[r.request_id for r in batch] for batch in batches]
    # a's bucket first (c, e), then the nearest bucket (d) while the batch stays <= 1300 tokens
    assert ids == [["a", "c", "e", "d"], ["b"]]
    # a batch never makes its head miss: fits() refuses what does
    batches = plan_batches(order, buckets, 8192, 1300, fits=lambda b: len(b) <= 2)
    assert [[r.request_id for r in batch] for batch in batches][0] == ["a", "c"]


def test_policy_step_orders_batches_and_predicts_ttft():
    policy = BulletPolicy(PerfModel(LLAMA8B, H100_SXM), LADDER, 132, SloTargets(0.5, 0.025), token_cap=2048)
    queue = (_req("long", 1800, 0.0), _req("short", 200, 0.0), _req("urgent", 900, 0.4))
    out = policy.step(StepState(6, queue, BUSY, 1.0))
    ids = [r.request_id for r in out.order]
    assert ids.index("urgent") < ids.index("long")  # least slack; "short" may pass it: both still make it
    assert set(out.predicted_ttft_s) == {"long", "short", "urgent"}
    assert out.predicted_ttft_s["urgent"] < 0.5
    assert sum(len(b) for b in out.batches) == 3
    new = policy.predict_new_ttft_s(StepState(6, queue, BUSY, 1.0), 500)
    assert new > policy.predict_new_ttft_s(StepState(6, (), BUSY, 1.0), 500) > 0


def test_balance_search_finds_the_brute_force_minimax():
    import random

    rng = random.Random(3)
    rule = _rule(tpot_ms=12.0)
    balanced = 0
    for trial in range(20):
        queue = [_req(str(i), rng.randint(200, 3000), rng.uniform(0.3, 0.46)) for i in range(rng.randint(1, 6))]
        state = _state(rng.randint(0, 3), queue, DecodeLoad(rng.randint(32, 128), rng.randint(32, 128) * 1500))
        batches = [[r] for r in queue]
        d = rule.decide(state, batches)
        if d.reason is not SplitReason.BALANCE:
            continue
        feasible = rule.feasible(state, batches, True)
        steps = [rule.decode_step_s(state, i) for i in range(len(LADDER))]
        scores = [max(steps[i] / 0.012, rule.ttft_outlook(state, batches, i, True, feasible)[2])
                  for i in range(len(LADDER))]
        assert scores[d.index] == pytest.approx(min(scores), rel=1e-9), trial
        balanced += 1
    assert balanced >= 5  # the crafted states do reach the branch


def test_saturation_is_computed_again_after_the_refresh_interval():
    from bullet_ray.perf.kernels import StepShape
    from bullet_ray.policy.bullet import SATURATION_REFRESH_S

    model = PerfModel(LLAMA8B, H100_SXM)
    policy = BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192)
    first = policy.saturation_tokens(100, True, now_s=10.0)
    for tokens, ratio in ((300, 1.8), (600, 1.5), (1200, 1.2), (2400, 1.0), (4000, 0.9)):
        for _ in range(4):
            shape = StepShape.prefill(tokens)
            model.observe(shape, 100, True, 0, ratio * model.predict(shape, 100, True, None).calibrated_s)
    assert policy.saturation_tokens(100, True, now_s=10.0 + SATURATION_REFRESH_S / 2) == first  # cached
    assert policy.saturation_tokens(100, True, now_s=10.0 + SATURATION_REFRESH_S) > first


def test_a_backlog_lets_batches_grow_past_saturation():
    """prefill_backlog_batch_tokens: while a queued request misses its target whatever the split, the batches grow
    to the setting (the head still keeping its target); without a backlog, or without the setting, they stop at
    saturation."""
    model = PerfModel(LLAMA8B, H100_SXM)
    fresh = tuple(_req(f"r{i}", 150) for i in range(40))
    late = _req("late", 150, waited_s=2.0)  # past its 500 ms target already: the split rule's backlog

    def first_batch_tokens(policy: BulletPolicy, queue) -> int:
        _, batches = policy.plan(StepState(0, queue, BUSY, 1.0), 0)
        return sum(r.num_remaining_tokens for r in batches[0])

    plain = BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192)
    grows = BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192, backlog_batch_tokens=6000)
    saturation = plain.saturation_tokens(grows.rule.prefill_sms(0), True, 1.0)
    assert 150 < saturation < 3000  # the roofline alone saturates early (331 tokens on 116 SMs)
    assert plain.rule.num_late(StepState(0, fresh + (late,), BUSY, 1.0), True) == 1
    assert first_batch_tokens(plain, fresh + (late,)) <= saturation  # no setting: saturation, backlog or not
    assert first_batch_tokens(grows, fresh) <= saturation  # no backlog: saturation
    assert saturation < first_batch_tokens(grows, fresh + (late,)) <= 6000  # a backlog: up to the setting
    # the batch's head keeps its target: a head with 50 ms left takes no batch that ends past it
    urgent = (_req("urgent", 150, waited_s=0.45),) + fresh + (late,)
    _, batches = grows.plan(StepState(0, urgent, BUSY, 1.0), 0)
    head = batches[0]
    assert head[0].request_id == "urgent"
    assert model.predict_prefill_s(sum(r.num_remaining_tokens for r in head), sum(r.num_prompt_tokens for r in head),
                                   grows.rule.prefill_sms(0), True, len(head)) <= 0.05
    assert sum(r.num_remaining_tokens for r in head) < 6000


def test_backlog_batch_tokens_config_names_the_field():
    from pydantic import ValidationError

    from bullet_ray.config import EngineConfig
    from bullet_ray.serve.config import EngineArgs

    assert EngineConfig().prefill_backlog_batch_tokens is None
    with pytest.raises(ConfigError, match="prefill_backlog_batch_tokens"):
        EngineConfig(prefill_backlog_batch_tokens=0)
    with pytest.raises(ValidationError, match="prefill_backlog_batch_tokens"):
        EngineArgs(prefill_backlog_batch_tokens=0)
    assert EngineArgs(prefill_backlog_batch_tokens=8192).to_engine_config().prefill_backlog_batch_tokens == 8192


def test_a_higher_saturation_share_makes_larger_batches():
    """prefill_saturation_share: where a batch stops growing (PerfModel.saturation_tokens at that share); the engine's
    config and the Serve deployment's both check it and hand it to the policy."""
    from pydantic import ValidationError

    from bullet_ray.config import EngineConfig
    from bullet_ray.serve.config import EngineArgs

    model = PerfModel(LLAMA8B, H100_SXM)
    sizes = [BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192,
                          saturation_share=share).saturation_tokens(116, True, now_s=1.0) for share in (0.8, 0.95, 0.99)]
    assert sizes == sorted(sizes) and sizes[0] < sizes[2] <= 8192
    assert sizes[1] == model.saturation_tokens(116, share=0.95, max_tokens=8192, other_busy=True)
    assert EngineConfig().prefill_saturation_share == 0.95
    for bad in (0, 1.5):
        with pytest.raises(ConfigError, match="prefill_saturation_share"):
            EngineConfig(prefill_saturation_share=bad)
        with pytest.raises(ValidationError, match="prefill_saturation_share"):
            EngineArgs(prefill_saturation_share=bad)
    assert EngineArgs(prefill_saturation_share=0.99).to_engine_config().prefill_saturation_share == 0.99


def test_fallback_target_rescues_lost_requests_into_the_slack_others_leave():
    # own time 0.1 ms a token (_own): A and B 0.1 s (B waited 0.05 s), L 0.2 s having waited 0.75 s
    a, b, lost = _req("A", 1000, 0.0), _req("B", 1000, 0.05), _req("L", 2000, 0.75)
    plain = SloTargets(0.5)
    assert [r.request_id for r in least_slack_order([a, b, lost], _own, plain)] == ["B", "A", "L"]
    # with a 1 s fallback L (which cannot make 0.5 s) makes 1 s only first; B and A still finish by 0.5 s behind it
    fb = SloTargets(0.5, fallback_ttft_s=1.0)
    assert [r.request_id for r in least_slack_order([a, b, lost], _own, fb)] == ["L", "B", "A"]
    # it goes as late as it still makes 1 s: having waited 0.65 s, after B
    later = _req("L", 2000, 0.65)
    assert [r.request_id for r in least_slack_order([a, b, later], _own, fb)] == ["B", "L", "A"]
    # with C behind, a 0.15 s M first would push C past 0.5 s: having waited 0.7 s it goes after C, makes 1 s ...
    c, m = _req("C", 1000, 0.25), _req("M", 1500, 0.7)
    order = least_slack_order([a, b, c, m], _own, fb)
    assert [r.request_id for r in order] == ["C", "M", "B", "A"]
    t = 0.0
    for r in order:  # ... and every request it passes still makes its target
        t += _own(r)
        assert r.waited_s + t <= (1.0 if r.request_id == "M" else 0.5)
    # having waited 0.9 s it makes 1 s nowhere: first among the lost, as without a fallback
    assert [r.request_id for r in least_slack_order([a, b, c, _req("M", 1500, 0.9)], _own, fb)][-1] == "M"
    # one past its fallback too stays at the back, in arrival order
    gone = _req("G", 1000, 0.95)
    assert least_slack_order([a, gone, lost], _own, fb)[-1].request_id == "G"
    # a prompt in progress stays first
    g = QueuedRequest("P", 4000, 0.0, num_computed_tokens=2048)
    assert least_slack_order([a, lost, g], _own, fb)[0].request_id == "P"


def test_fallback_target_is_after_the_target_and_takes_the_margin():
    with pytest.raises(ConfigError, match="ttft_fallback_ms"):
        SloTargets(0.5, fallback_ttft_s=0.5)
    t = SloTargets(0.5, fallback_ttft_s=1.0, margin_s=0.05)
    assert t.fallback_target_s(100) == pytest.approx(0.95) and t.ttft_target_s(100) == pytest.approx(0.45)
    assert SloTargets(0.5).fallback_target_s(100) is None
    # per-token targets: never before the request's own target
    per = SloTargets(0.5, ttft_per_token_s=0.003, fallback_ttft_s=1.0)
    assert per.fallback_target_s(1000) == pytest.approx(3.0)


def test_a_rescued_head_fits_its_batch_to_the_fallback_target():
    from bullet_ray.policy.ordering import head_target_s

    fb = SloTargets(0.5, fallback_ttft_s=1.0)
    assert head_target_s(_req("H", 1000, 0.1), 0.1, fb) == 0.5  # makes its own target: fitted to it
    assert head_target_s(_req("H", 1000, 0.45), 0.1, fb) == 1.0  # cannot: fitted to the fallback
    assert head_target_s(_req("H", 1000, 0.45), 0.1, SloTargets(0.5)) == 0.5  # no fallback: as before


def test_most_on_time_keeps_the_largest_set_that_makes_its_deadlines():
    """Moore-Hodgson against brute force on random queues: as many requests on time as any subset can be."""
    import itertools
    import random

    from bullet_ray.policy.ordering import most_on_time

    rng = random.Random(7)
    for _ in range(200):
        queue = [_req(str(i), rng.randint(100, 4000), rng.uniform(0.0, 0.4)) for i in range(rng.randint(1, 7))]
        own = {r.request_id: _own(r) for r in queue}
        deadline = {r.request_id: 0.5 - r.waited_s for r in queue}
        start = rng.uniform(0.0, 0.1)
        kept, given_up = most_on_time(queue, own, deadline, start)
        assert {r.request_id for r in kept} | {r.request_id for r in given_up} == set(own)
        t = start
        for r in kept:  # served one after another in the order returned, each makes its deadline
            t += own[r.request_id]
            assert t <= deadline[r.request_id] + 1e-12
        best = max(n for n in range(len(queue) + 1) for subset in itertools.combinations(queue, n)
                   if _on_time_in_deadline_order(subset, own, deadline, start))
        assert len(kept) == best


def _on_time_in_deadline_order(subset, own, deadline, start) -> bool:
    t = start
    for r in sorted(subset, key=lambda r: deadline[r.request_id]):
        t += own[r.request_id]
        if t > deadline[r.request_id]:
            return False
    return True


def _on_time(order, start_s: float = 0.0) -> int:
    """How many of `order` make a 0.5 s TTFT target, prefilled one after another (_own each) from `start_s`."""
    t, n = start_s, 0
    for r in order:
        t += _own(r)
        n += r.waited_s + t <= 0.5
    return n


def test_max_on_time_gives_up_a_long_prompt_that_would_make_short_ones_late():
    """Each request can make its target alone, but not all together: in the least-slack order the 4k prompt runs
    second and three short ones end late; max_on_time gives the 4k prompt up (after the others, with the late ones)
    and all four short ones make it."""
    long_one = _req("L", 4000, 0.05)  # 0.4 s alone, slack 0.05
    short = [_req(f"S{i}", 500, 0.2) for i in range(4)]  # 0.05 s each, slack 0.25
    default = least_slack_order([long_one, *short], _own, SloTargets(0.5))
    assert [r.request_id for r in default][:2] == ["S0", "L"] and _on_time(default) == 2
    mot = least_slack_order([long_one, *short], _own, SloTargets(0.5), order="max_on_time")
    assert [r.request_id for r in mot][-1] == "L" and _on_time(mot) == 4
    # a prompt in progress stays first, and the time it takes counts against the rest
    started = QueuedRequest("G", 4000, 0.0, num_computed_tokens=2048)
    order = least_slack_order([started, long_one, *short], _own, SloTargets(0.5), order="max_on_time")
    assert order[0].request_id == "G" and order[-1].request_id == "L"


def test_policy_passes_max_on_time_to_its_order():
    model = PerfModel(LLAMA8B, H100_SXM)
    # on 116 prefill SMs beside a busy decode: 8,000 tokens 0.32 s (slack 0.08), 1,000 tokens 0.036 s (deadline 0.2)
    queue = (_req("L", 8000, 0.1), *(_req(f"S{i}", 1000, 0.3) for i in range(4)))
    state = StepState(6, queue, BUSY, 1.0)
    plain = BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192)
    mot = BulletPolicy(model, LADDER, 132, SloTargets(0.5, 0.025), token_cap=8192, prefill_order="max_on_time")
    assert [r.request_id for r in plain.step(state).order] == ["S0", "S1", "L", "S2", "S3"]
    assert [r.request_id for r in mot.step(state).order] == ["S0", "S1", "S2", "S3", "L"]


def _within(order, target_s: float, start_s: float = 0.0) -> int:
    """How many of `order` make a TTFT target of `target_s`, prefilled one after another (_own each)."""
    t, n = start_s, 0
    for r in order:
        t += _own(r)
        n += r.waited_s + t <= target_s + 1e-9
    return n


def test_fallback_first_keeps_the_long_prompt_that_max_on_time_gives_up():
    """L (4k tokens, 0.4 s) has waited 0.49 s: it misses 0.5 s whatever happens and makes the 1 s fallback only if it
    starts within 0.11 s; eight short ones (0.05 s each, waited 0.19 s) can make 0.5 s six at a time. max_on_time
    keeps six short ones within 0.5 s and L finds no place before its fallback passes (8 of 9 within 1 s);
    fallback_first keeps all nine within 1 s: L after two short ones, the other six short ones after it, late for
    0.5 s but within 1 s."""
    long_one = _req("L", 4000, 0.49)
    short = [_req(f"S{i}", 500, 0.19) for i in range(8)]
    fb = SloTargets(0.5, fallback_ttft_s=1.0)
    mot = least_slack_order([long_one, *short], _own, fb, order="max_on_time")
    first = least_slack_order([long_one, *short], _own, fb, order="fallback_first")
    assert (_within(mot, 0.5), _within(mot, 1.0)) == (6, 8)
    assert (_within(first, 0.5), _within(first, 1.0)) == (2, 9)
    assert [r.request_id for r in first].index("L") == 2 and sorted(r.request_id for r in first) == \
        sorted(r.request_id for r in [long_one, *short])
    # without a fallback target it is max_on_time
    plain = SloTargets(0.5)
    assert [r.request_id for r in least_slack_order([long_one, *short], _own, plain, order="fallback_first")] == \
        [r.request_id for r in least_slack_order([long_one, *short], _own, plain, order="max_on_time")]


def test_fallback_first_gives_up_what_would_cost_several_their_fallback():
    """Twelve short ones behind a started prompt (0.1 s): keeping L within 1 s would push six of them past theirs, so L is given up (Moore-Hodgson
    on the fallback deadlines counts requests, not tokens), goes last, and every short one makes 1 s; a request that
    cannot make its fallback at all goes after the kept ones too, and a started prompt stays first."""
    long_one = _req("L", 4000, 0.5)
    short = [_req(f"S{i}", 500, 0.2) for i in range(12)]
    gone = _req("X", 100, 1.2)  # past its fallback already
    started = QueuedRequest("G", 1000, 0.0, num_computed_tokens=512)
    order = least_slack_order([gone, long_one, *short, started], _own, SloTargets(0.5, fallback_ttft_s=1.0),
                              order="fallback_first")
    ids = [r.request_id for r in order]
    assert ids[0] == "G" and set(ids[-2:]) == {"L", "X"}
    assert _within(order[1:13], 1.0, start_s=_own(started)) == 12


def test_most_within_fallback_plans_each_for_its_own_target_where_it_can():
    """Room for all three within their own deadlines: the order is plain deadline order and nothing moves back."""
    a, b, c = _req("A", 1000, 0.0), _req("B", 500, 0.0), _req("C", 2000, 0.0)
    own = {r.request_id: _own(r) for r in (a, b, c)}
    placed = most_within_fallback([a, b, c], own, {"A": 0.3, "B": 0.1, "C": 0.5}, {"A": 1.0, "B": 1.0, "C": 1.0}, 0.0)
    assert [r.request_id for r in placed] == ["B", "A", "C"]


def test_split_rule_judges_a_fallback_planned_request_by_its_fallback():
    """A request the order plans for its fallback (it ends past its own target, within the fallback) is not TTFT risk
    to the split rule; judged by its own target it would be. BulletPolicy hands the rule those targets only with the
    fallback_first order."""
    rule = _rule()
    r = _req("a", 2000, 0.45)  # past 0.5 s whatever the split, within 1 s
    state = _state(6, [r])
    assert rule.ttft_outlook(state, [[r]], 6, True, {"a"})[0] == 1
    assert rule.ttft_outlook(state, [[r]], 6, True, {"a"}, {"a": 1.0})[0] == 0
    model = PerfModel(LLAMA8B, H100_SXM)
    short = [_req(f"S{i}", 1000, 0.3) for i in range(6)]
    fb = SloTargets(0.5, 0.025, fallback_ttft_s=1.0)
    first = BulletPolicy(model, LADDER, 132, fb, token_cap=8192, prefill_order="fallback_first")
    mot = BulletPolicy(model, LADDER, 132, fb, token_cap=8192, prefill_order="max_on_time")
    busy = _state(6, short)
    planned = first.fallback_planned_s(busy, first.plan(busy, 6)[0])
    assert planned and all(t == pytest.approx(1.0) for t in planned.values()) and mot.fallback_planned_s(busy, short) == {}


def test_fallback_first_keeps_every_kept_request_within_its_fallback():
    """Every request the fallback deadlines' Moore-Hodgson keeps ends by its fallback in the order returned, in random
    queues (a moved-back request once went behind later ones and past its fallback: the review's three-request case
    first), and an unknown order name is an error naming the known ones."""
    import random

    from bullet_ray.config import PREFILL_ORDERS
    from bullet_ray.policy.ordering import ORDERS

    assert ORDERS == PREFILL_ORDERS
    fb = SloTargets(0.5, fallback_ttft_s=1.0)
    case = [_req("r0", 500, 0.412), _req("r1", 8000, 0.137), _req("r2", 500, 0.072)]
    rng = random.Random(0)
    queues = [case] + [[_req(f"q{i}", rng.choice((100, 500, 1000, 2000, 4000, 8000)), rng.uniform(0.0, 0.9))
                        for i in range(rng.randint(3, 25))] for _ in range(300)]
    for queue in queues:
        kept, _ = most_on_time([r for r in queue if 1.0 - r.waited_s - _own(r) >= 0], {r.request_id: _own(r) for r in queue},
                               {r.request_id: 1.0 - r.waited_s for r in queue}, 0.0)
        for passes in (0, 8):  # the order itself, then with the shorter-first passes
            t, ends = 0.0, {}
            for r in least_slack_order(queue, _own, fb, order="fallback_first", max_passes=passes):
                t += _own(r)
                ends[r.request_id] = r.waited_s + t
            assert all(ends[r.request_id] <= 1.0 + 1e-9 for r in kept), [r.request_id for r in queue]
    with pytest.raises(ValueError, match="unknown prefill order 'fallback-first'; choose least_slack"):
        least_slack_order(case, _own, fb, order="fallback-first")
