"""The cuBLAS SM-target helpers that need no GPU: the keep rule, the switch, the range check, and PyTorch's
settings restored however the body ends (PyTorch's setters faked: a CPU build has no cuBLASLt)."""

from __future__ import annotations

import pytest
import torch

from bullet_ray.engine import gemm_target


def test_a_target_is_kept_only_when_faster_by_more_than_the_margin():
    assert gemm_target.keeps_target(10.0, 9.7)  # 3% faster
    assert not gemm_target.keeps_target(10.0, 9.9)  # 1%: within replay noise
    assert not gemm_target.keeps_target(10.0, 10.0)
    assert not gemm_target.keeps_target(10.0, 20.0)  # the 2x slower case measured on 48 SMs
    assert gemm_target.keeps_target(10.0, 9.9, margin=0.0)


@pytest.mark.parametrize("value,enabled", [(None, True), ("tune", True), ("1", True), ("0", False), ("off", False)])
def test_tuning_follows_the_environment(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv("BULLET_RAY_GEMM_SM_TARGET", raising=False)
    else:
        monkeypatch.setenv("BULLET_RAY_GEMM_SM_TARGET", value)
    assert gemm_target.tuning_enabled() is enabled


def test_a_torch_without_the_carveout_turns_tuning_off(monkeypatch):
    monkeypatch.delenv("BULLET_RAY_GEMM_SM_TARGET", raising=False)
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    gemm_target._torch_has_carveout.cache_clear()
    try:
        assert gemm_target.tuning_enabled() is False
    finally:
        gemm_target._torch_has_carveout.cache_clear()


def test_a_bad_setting_or_target_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("BULLET_RAY_GEMM_SM_TARGET", "yes")
    with pytest.raises(ValueError, match="BULLET_RAY_GEMM_SM_TARGET must be one of tune, 1, 0, off"):
        gemm_target.tuning_enabled()
    for sms in (0, 132, 200):
        with pytest.raises(ValueError, match="0 < sms < 132"), gemm_target.sm_target(sms, 132):
            pass


@pytest.fixture
def fake_settings(monkeypatch):
    """PyTorch's BLAS library and carveout as plain values (the CPU build refuses cuBLASLt)."""
    state = {"library": "cublas", "carveout": None}

    def library(backend=None):
        if backend is not None:
            state["library"] = backend
        return state["library"]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", library)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["carveout"])
    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", lambda c: state.__setitem__("carveout", c))
    return state


def test_the_target_holds_inside_and_is_undone_after_even_on_an_error(fake_settings):
    with gemm_target.sm_target(16, 132):
        assert fake_settings == {"library": "cublaslt", "carveout": 116}
    assert fake_settings == {"library": "cublas", "carveout": None}
    with pytest.raises(RuntimeError, match="capture failed"), gemm_target.sm_target(100, 132):
        assert fake_settings["carveout"] == 32
        raise RuntimeError("capture failed")
    assert fake_settings == {"library": "cublas", "carveout": None}
