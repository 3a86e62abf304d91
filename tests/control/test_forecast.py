"""The controller's forecaster on synthetic series: a ramp is predicted ahead, a step converges."""

from __future__ import annotations

import pytest

from bullet_ray.control.forecast import Holt, LoadForecaster, LoadSample
from bullet_ray.errors import ConfigError


def test_constant_series_forecasts_itself():
    h = Holt()
    for _ in range(20):
        h.update(5.0)
    assert h.forecast(10) == pytest.approx(5.0)


def test_ramp_is_predicted_ahead():
    h = Holt(alpha=0.5, beta=0.3, phi=1.0)
    for t in range(30):
        h.update(2.0 * t)  # the last value is 58
    assert h.forecast(0) == pytest.approx(58.0, abs=0.5)
    assert h.forecast(5) == pytest.approx(68.0, abs=1.0)  # the ramp continued 5 steps
    damped = Holt(alpha=0.5, beta=0.3, phi=0.9)
    for t in range(30):
        damped.update(2.0 * t)
    assert 58.0 < damped.forecast(5) < 68.0  # damping: ahead of now, short of the undamped line


def test_step_converges_to_the_new_level():
    h = Holt()
    for _ in range(10):
        h.update(1.0)
    for _ in range(25):
        h.update(10.0)
    assert h.forecast(3) == pytest.approx(10.0, rel=0.03)
    assert abs(h.trend) < 0.2


def test_forecast_is_never_negative_and_bad_readings_are_skipped():
    h = Holt(phi=1.0)
    for v in (10.0, 5.0, 0.0):
        h.update(v)
    h.update(float("nan"))
    h.update(-3.0)
    assert h.num_observations == 3
    assert h.forecast(10) == 0.0


def test_load_forecaster_lengths_and_persistence():
    f = LoadForecaster(interval_s=1.0, horizon_s=5.0)
    assert f.forecast().rate_rps == 0.0  # nothing seen: no load, default lengths
    assert f.forecast().mean_prompt_tokens == 512.0
    for t in range(20):
        f.update(LoadSample(rate_rps=1.0 + 0.5 * t, mean_prompt_tokens=200.0, mean_output_tokens=None))
    fc = f.forecast()
    assert fc.rate_rps > 10.5  # the last measured rate; the forecast is ahead of it
    assert fc.mean_prompt_tokens == pytest.approx(200.0)
    assert fc.mean_output_tokens == 128.0
    assert fc.tokens_per_s == pytest.approx(fc.rate_rps * (200.0 + 128.0))
    g = LoadForecaster(interval_s=1.0, horizon_s=5.0)
    g.load_dict(f.to_dict())
    assert g.forecast() == fc


@pytest.mark.parametrize("kwargs,field", [({"alpha": 0}, "forecast_alpha"), ({"phi": 1.5}, "forecast_phi")])
def test_bad_parameters_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        Holt(**kwargs)


def test_a_restored_forecaster_keeps_its_levels_and_its_own_factors():
    """After a restart or a config change the smoothed level and trend go on, but alpha / beta / phi (and the
    interval and horizon) are the new config's, not the saved ones."""
    old = LoadForecaster(5.0, 30.0, 0.5, 0.3, 0.98)
    for rate in (10.0, 12.0, 14.0):
        old.update(LoadSample(rate, 100.0, 50.0))
    new = LoadForecaster(1.0, 120.0, 0.9, 0.2, 0.9)
    new.load_dict(old.to_dict())
    assert (new.rate.alpha, new.rate.beta, new.rate.phi) == (0.9, 0.2, 0.9)
    assert (new.rate.level, new.rate.trend, new.rate.num_observations) == \
        (old.rate.level, old.rate.trend, old.rate.num_observations)
    assert new.prompt.level == old.prompt.level and new.output.level == old.output.level


def test_lengths_are_forecast_at_their_level_not_carried_down_by_a_noisy_trend():
    """A steady 8-token output mean read with a lagging counter (a low interval now and then, then catching up) keeps
    a forecast near 8 whatever the horizon, while the rising rate is carried ahead (the integration test's rising
    load once saw the output mean's trend forecast 0 and the second replica come late)."""
    f = LoadForecaster(interval_s=2.0, horizon_s=20.0)
    for t, out in enumerate([8.0, 8.0, 3.0, 8.0, 2.0, 1.5, 8.0]):
        f.update(LoadSample(rate_rps=0.3 + 0.2 * t, mean_prompt_tokens=4.0, mean_output_tokens=out))
    fc = f.forecast()
    assert fc.mean_output_tokens == pytest.approx(f.output.level) and 3.0 < fc.mean_output_tokens < 8.0
    assert fc.mean_prompt_tokens == pytest.approx(4.0)
    assert fc.rate_rps > 0.3 + 0.2 * 6  # the rate still leads by its trend


def test_a_first_outlier_does_not_drag_the_length_level_down():
    """The integration test's controller log: output means of 11.0, then 8.0, 7.57, 7.7, 8.0 ... A trend seeded by
    the first difference (-3) held the level near 5.7 for four intervals even though the forecast never carried it
    ahead; smoothed without a trend the level stays within the readings."""
    f = LoadForecaster(interval_s=2.0, horizon_s=20.0)
    readings = [11.0, 8.0, 7.57, 7.7, 8.0, 8.0, 8.0]
    levels = []
    for mean in readings:
        f.update(LoadSample(1.0, 4.0, mean))
        levels.append(f.forecast().mean_output_tokens)
    assert all(7.5 <= level <= 11.0 for level in levels), levels
    assert levels[-1] == pytest.approx(8.0, abs=0.1) and f.output.trend == 0.0


def test_the_rate_is_carried_ahead_over_the_readings_age_too():
    """A reading over a window describes the window's middle: the forecast carries the rate's trend over the horizon
    plus that age; the lengths (no trend) and the reported horizon do not change."""
    f = LoadForecaster(interval_s=2.0, horizon_s=20.0)
    for t in range(12):
        f.update(LoadSample(1.0 + 0.2 * t, 4.0, 8.0))  # +0.2 req/s per interval
    now, aged = f.forecast(), f.forecast(age_s=4.0)
    assert aged.horizon_s == now.horizon_s == 20.0
    # two more (damped) intervals of the trend: steps 11 and 12 of a 20 s horizon at 2 s
    assert f.rate.trend == pytest.approx(0.2, rel=0.05)
    assert aged.rate_rps - now.rate_rps == pytest.approx(f.rate.trend * (f.rate.phi ** 11 + f.rate.phi ** 12))
    assert (aged.mean_prompt_tokens, aged.mean_output_tokens) == (now.mean_prompt_tokens, now.mean_output_tokens)
    assert f.forecast(age_s=-3.0) == now  # a reading is never younger than now
