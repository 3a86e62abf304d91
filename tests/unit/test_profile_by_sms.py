"""benchmarks.profile_by_sms on the shipped H100 profile: the rates are the samples' own, the errors by SM count
are the static model's, the trial compute curve keeps the whole device at peak and bends below it."""

from __future__ import annotations

import pytest

from benchmarks.profile_by_sms import (
    SHIPPED,
    SaturatingCompute,
    fresh_prefill_rates,
    main,
    signed_errors_by_sms,
)
from bullet_ray.models.loader import resolve_source
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import load_profile


def test_rates_and_errors_come_from_the_profiles_own_samples():
    profile = load_profile(SHIPPED)
    rates = fresh_prefill_rates(list(profile.samples))
    sample = next(s for s in profile.samples if s.phase == "prefill" and s.sms == 116 and not s.other_busy
                  and s.shape.num_tokens == s.shape.num_context_tokens == 2048)
    assert rates[(2048, 116)][False] == pytest.approx(2048 / sample.measured_s)
    model = PerfModel.from_profile(profile, resolve_source("dummy:llama-3.1-8b").config)
    by_sms = signed_errors_by_sms(model, list(profile.samples), 1024)
    assert set(by_sms) == {s.sms for s in profile.samples if s.phase == "prefill"}
    assert by_sms[20] > 0 > by_sms[116]  # too slow on few SMs, too fast on many: the bias docs/policy.md quotes


def test_the_trial_compute_curve_keeps_the_peak_and_bends_below_it():
    gpu = load_profile(SHIPPED).gpu
    curve = SaturatingCompute(**gpu.to_dict(), compute_saturation_sms=200.0, compute_knee=1.0)
    assert curve.compute_flops_per_s(gpu.sm_count) == pytest.approx(gpu.compute_flops_per_s(gpu.sm_count))
    assert curve.compute_flops_per_s(66) > gpu.compute_flops_per_s(66)  # concave: more than linear below the top
    assert curve.bandwidth_bytes_per_s(66) == gpu.bandwidth_bytes_per_s(66)


def test_bad_arguments_are_one_line_errors(capsys, tmp_path):
    assert main(["--compute-curve", "200"]) == 2
    assert main(["--compute-curve", "0,1"]) == 2
    assert main([str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
