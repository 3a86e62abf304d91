"""The bullet schedule's SM split policy: SM scaling of decode speed, predicted decode steps on every split,
and the split chosen for each load (DESIGN.md's rule)."""

from __future__ import annotations

import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.gpu.partition import default_ladder
from bullet_ray.policy.split import Load, SmScaling, SplitPolicy, SplitTargets

LADDER = default_ladder(132)  # 16, 24, ..., 112 decode SMs
MIDDLE = (len(LADDER) - 1) // 2


def _policy(tpot_ms=25.0, ttft_ms=500.0) -> SplitPolicy:
    return SplitPolicy(LADDER, SmScaling(132), SplitTargets(ttft_ms / 1e3, tpot_ms / 1e3))


def test_scaling_follows_the_measured_points():
    s = SmScaling(132)
    assert s(132) == 1.0 and s(200) == 1.0
    assert s(16) == pytest.approx(0.510) and s(72) == pytest.approx(0.941)
    assert s(4) == pytest.approx(0.271 * 4 / 8)  # proportional below the first point
    assert s(40) == pytest.approx((0.754 + 0.845) / 2)  # halfway between 32 and 48 SMs
    values = [s(n) for n in range(1, 133)]
    assert values == sorted(values)


def test_bad_inputs_name_the_field():
    with pytest.raises(ConfigError, match="tpot_target_ms"):
        SplitTargets(tpot_s=0)
    with pytest.raises(ConfigError, match="decode_sm_counts"):
        SplitPolicy([64, 16], SmScaling(132), SplitTargets())
    with pytest.raises(ConfigError, match="sm_scaling"):
        SmScaling(132, [(0.5, 1.5)])


def test_without_measurements_decode_gets_the_most_and_an_idle_decode_keeps_its_split():
    p = _policy()
    assert p.predicted_step_s(0) is None
    assert p.choose(MIDDLE, Load(num_decoding=3, num_prefilling=2, predicted_ttft_s=None)) == len(LADDER) - 1
    assert p.choose(MIDDLE, Load(0, 5, 0.1)) == MIDDLE  # nothing decoding: keep (no slow restart on few SMs)
    assert p.choose(MIDDLE, Load(0, 0, None)) == MIDDLE


def test_decode_gets_the_fewest_sms_that_keep_its_step_under_slack_times_the_target():
    p = _policy(tpot_ms=25.0)
    p.max_shrink = len(LADDER)  # no damping of the size of a move here
    assert p.observe_decode_step(step=1, step_time_s=0.012, index=MIDDLE)  # 12 ms on 64 SMs
    assert not p.observe_decode_step(step=1, step_time_s=0.5, index=MIDDLE)  # the same step again: ignored
    i = p.choose(MIDDLE, Load(10, 3, 0.2))
    limit = 0.8 * 0.025
    assert p.predicted_step_s(i) <= limit < p.predicted_step_s(i - 1)
    assert p.predicted_step_s(MIDDLE) == pytest.approx(0.012)  # the measured split predicts what was measured
    assert i < MIDDLE  # 12 ms has slack: SMs go to prefill


def test_damping_holds_inside_the_band_and_gives_sms_away_two_entries_at_a_time():
    p = _policy(tpot_ms=25.0)
    p.observe_decode_step(1, 0.017, MIDDLE)  # 17 ms: between 0.6 x 25 and 0.8 x 25
    assert p.choose(MIDDLE, Load(10, 3, 0.2)) == MIDDLE
    fast = _policy(tpot_ms=25.0)
    fast.observe_decode_step(1, 0.006, MIDDLE)  # 6 ms: far below the band
    steps, current = [], MIDDLE
    for _ in range(5):
        current = fast.choose(current, Load(10, 3, 0.2))
        steps.append(current)
    assert steps[0] == MIDDLE - 2 and steps[1] == MIDDLE - 4  # two entries per decision
    assert steps[-1] == fast.choose(steps[-1], Load(10, 3, 0.2))  # then it stays
    slow = _policy(tpot_ms=25.0)
    slow.observe_decode_step(1, 0.030, 0)  # 30 ms on 16 SMs: needs more, taken at once
    grown = slow.choose(0, Load(10, 3, 0.2))
    assert grown > 2 and slow.predicted_step_s(grown) <= 0.02


def test_longer_decode_steps_get_more_sms():
    p = _policy()
    chosen = []
    for step, ms in enumerate((8, 16, 30, 60, 200), start=1):
        p.ema_weight = 1.0  # follow each measurement fully
        p.observe_decode_step(step, ms / 1e3, MIDDLE)
        chosen.append(p.choose(MIDDLE, Load(32, 4, 0.1)))
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]
    assert chosen[-1] == len(LADDER) - 1  # no split meets the target: decode gets the most


def test_missed_ttft_aims_decode_at_the_target_itself_and_balances_at_the_middle():
    p = _policy(tpot_ms=25.0, ttft_ms=500.0)
    p.max_shrink = len(LADDER)
    p.observe_decode_step(1, 0.013, MIDDLE)  # 13 ms on 64 SMs: below the band either way
    relaxed = p.choose(MIDDLE, Load(10, 3, predicted_ttft_s=2.0))
    assert p.predicted_step_s(relaxed) <= 0.025
    assert relaxed == 0 or p.predicted_step_s(relaxed - 1) > 0.025
    assert relaxed < p.choose(MIDDLE, Load(10, 3, predicted_ttft_s=0.1))  # TTFT met: keep the headroom
    slow = _policy()
    slow.observe_decode_step(1, 0.040, MIDDLE)  # decode misses TPOT even on 64 SMs, and TTFT is missed too
    assert slow.choose(MIDDLE, Load(10, 3, predicted_ttft_s=2.0)) == MIDDLE
