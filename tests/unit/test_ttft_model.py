"""The prefill time model behind the engine's predicted TTFT: fit, fallback, prediction."""

from __future__ import annotations

import pytest

from bullet_ray.policy.ttft import PrefillTimeModel


def test_no_prediction_before_any_step():
    assert PrefillTimeModel(budget=512).predict_ttft(100, 10) is None


def test_fit_recovers_step_and_token_costs():
    model = PrefillTimeModel(budget=512)
    for step, tokens in enumerate([64, 128, 256, 512, 300, 17]):
        model.observe_step(step, tokens, 0.004 + 2e-5 * tokens)
    a, b = model.coefficients()
    assert a == pytest.approx(0.004) and b == pytest.approx(2e-5)
    # 1000 queued + 100 new tokens = 1100 tokens in ceil(1100 / 512) = 3 steps
    assert model.predict_ttft(1000, 100) == pytest.approx(3 * 0.004 + 1100 * 2e-5)
    # per prompt token more: its own cost and a full step's share of the per-step cost
    assert model.seconds_per_token() == pytest.approx(2e-5 + 0.004 / 512)
    assert PrefillTimeModel(budget=512).seconds_per_token() is None


def test_a_repeated_step_counter_is_one_sample():
    model = PrefillTimeModel(budget=512)
    model.observe_step(7, 100, 0.01)
    model.observe_step(7, 100, 0.01)
    model.observe_step(7, 400, 0.04)
    assert len(model._samples) == 1


def test_one_step_size_uses_time_per_token_and_the_average_prompt():
    model = PrefillTimeModel(budget=4096)
    model.observe_step(1, 200, 0.02)
    for n in (100, 100, 100):
        model.observe_prompt(n)
    assert model.predict_ttft(0) == pytest.approx(100 * 1e-4)
    assert model.typical_prompt_tokens() == 100 and PrefillTimeModel(budget=8).typical_prompt_tokens() == 1
    assert model.predict_ttft(300) == pytest.approx(400 * 1e-4)
