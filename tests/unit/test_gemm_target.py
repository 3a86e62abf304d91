"""The cuBLAS SM-target helpers that need no GPU: the keep rule, the switch and the target's range check."""

from __future__ import annotations

import pytest

from bullet_ray.engine import gemm_target


def test_a_target_is_kept_only_when_faster_by_more_than_the_margin():
    assert gemm_target.keeps_target(10.0, 9.7)  # 3% faster
    assert not gemm_target.keeps_target(10.0, 9.9)  # 1%: within replay noise
    assert not gemm_target.keeps_target(10.0, 10.0)
    assert not gemm_target.keeps_target(10.0, 20.0)  # the 2x slower case measured on 48 SMs
    assert gemm_target.keeps_target(10.0, 9.9, margin=0.0)


@pytest.mark.parametrize("value,enabled", [(None, True), ("tune", True), ("0", False)])
def test_tuning_follows_the_environment(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("BULLET_RAY_GEMM_SM_TARGET", raising=False)
    else:
        monkeypatch.setenv("BULLET_RAY_GEMM_SM_TARGET", value)
    assert gemm_target.tuning_enabled() is enabled


def test_a_bad_setting_or_target_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BULLET_RAY_GEMM_SM_TARGET", "yes")
    with pytest.raises(ValueError, match="BULLET_RAY_GEMM_SM_TARGET must be tune or 0"):
        gemm_target.tuning_enabled()
    for sms in (0, 132, 200):
        with pytest.raises(ValueError, match="0 < sms < 132"), gemm_target.sm_target(sms, 132):
            pass
