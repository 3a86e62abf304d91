"""The performance model on fake profiles: roofline numbers, kernel costs, the calibration fit, the online
correction, TTFT of a queue, and the profile file (pure Python, milliseconds)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.calibration import Calibration, OnlineCorrection, PhaseCalibration
from bullet_ray.perf.calibration.fit import SERVED_MIN_ALONE_SHAPES
from bullet_ray.perf.kernels import KernelClass, StepShape, kernel_costs
from bullet_ray.perf.model import PerfModel, quantile, relative_errors
from bullet_ray.perf.profile import (
    Profile,
    Sample,
    find_profile,
    load_profile,
    model_fingerprint,
    save_profile,
)
from bullet_ray.perf.roofline import H100_SXM, GpuSpec, roofline_time_s
from bullet_ray.perf.ttft import batches_finish_s, predict_queue_ttft_s

PRESETS = Path(__file__).resolve().parents[2] / "bullet_ray" / "models" / "presets"
LLAMA8B = ModelConfig.from_hf_dict(json.loads((PRESETS / "llama-3.1-8b.json").read_text()))
# a round GPU: 100 SMs, 100 TFLOP/s, 1000 GB/s, bandwidth nearly a hard min(1, n / 20)
FAKE = GpuSpec("fake", 100, 100.0, 1000.0, 20.0, knee=50.0)


def test_the_model_imports_no_torch():
    assert "bullet_ray.perf.model" in sys.modules
    import subprocess

    code = "import sys, bullet_ray.perf, bullet_ray.perf.ttft, bullet_ray.perf.loading; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_roofline_compute_scales_with_sms_and_bandwidth_saturates():
    assert FAKE.compute_flops_per_s(50) == pytest.approx(50e12)
    assert FAKE.bandwidth_bytes_per_s(10) == pytest.approx(500e9, rel=0.01)  # linear below saturation
    assert FAKE.bandwidth_bytes_per_s(40) == pytest.approx(1000e9, rel=0.01)  # flat above it
    # a GEMV (intensity 1) is bandwidth-bound: 1 GB takes 1 ms from 20 SMs up
    assert roofline_time_s(1e9, 1e9, 40, FAKE) == pytest.approx(1e-3, rel=0.01)
    # a GEMM (intensity 1000) is compute-bound: halving the SMs doubles its time
    assert roofline_time_s(1e12, 1e9, 50, FAKE) == pytest.approx(2 * roofline_time_s(1e12, 1e9, 100, FAKE))
    # the crossover sits at the ridge intensity: compute / bandwidth = 100 FLOP/byte on the whole GPU
    assert FAKE.ridge_intensity(100) == pytest.approx(100, rel=0.01)
    assert FAKE.ridge_intensity(10) == pytest.approx(20, rel=0.02)


def test_h100_bandwidth_curve_fits_the_measured_gemv():
    measured = {8: 708, 16: 1335, 32: 1972, 48: 2210, 72: 2461, 132: 2616}  # GB/s, GPU.md
    for sms, gbs in measured.items():
        assert H100_SXM.bandwidth_bytes_per_s(sms) / 1e9 == pytest.approx(gbs, rel=0.04)


def test_kernel_costs_of_a_decode_step_read_the_weights_once():
    costs = kernel_costs(LLAMA8B, StepShape.decode(1, 1), dtype_bytes=2)
    weight_bytes = sum(c.num_bytes for k, c in costs.items() if k.group == "linear")
    # every weight matrix but the embedding table: 2 bytes x (params - vocab x hidden)
    expected = 2 * (LLAMA8B.num_params - LLAMA8B.vocab_size * LLAMA8B.hidden_size)
    assert weight_bytes == pytest.approx(expected, rel=0.001)
    assert costs[KernelClass.ATTENTION_DECODE].flops == 4 * LLAMA8B.q_size * 1 * LLAMA8B.num_hidden_layers
    prefill = kernel_costs(LLAMA8B, StepShape.prefill(2048), 2)
    linear_flops = sum(c.flops for k, c in prefill.items() if k.group == "linear")
    # 2 FLOPs per weight per token, lm_head for the one sampled row
    body = 2 * 2048 * (LLAMA8B.num_params - 2 * LLAMA8B.vocab_size * LLAMA8B.hidden_size)
    assert linear_flops == pytest.approx(body + 2 * LLAMA8B.hidden_size * LLAMA8B.vocab_size, rel=0.001)


def test_step_shapes_count_causal_pairs():
    assert StepShape.of_prompts([4]).num_attention_pairs == 10  # 1 + 2 + 3 + 4
    assert StepShape.of_prompts([4, 2]).num_attention_pairs == 13
    assert StepShape.of_prompts([6], cached_lens=[2]).num_attention_pairs == 4 * 6 - 6  # 3+4+5+6
    assert StepShape.prefill(4).num_attention_pairs == 10
    assert StepShape.decode(8, 800).num_attention_pairs == 800
    with pytest.raises(ConfigError, match="num_context_tokens"):
        StepShape("prefill", 10, 1, 5, 10)


def test_prefill_crossover_and_saturation():
    model = PerfModel(LLAMA8B, H100_SXM)
    # bf16 weights: crossover tokens = ridge intensity (FLOP/byte) x 2 bytes / 2 FLOPs
    assert model.crossover_tokens(132) == pytest.approx(784e12 / 2616e9, rel=0.001)
    # fewer SMs -> a lower ridge (bandwidth saturates, compute does not) -> earlier crossover
    assert model.crossover_tokens(32) < model.crossover_tokens(132) / 2
    # below the crossover a prefill step costs about the same as one token; above it time grows with tokens
    t1, t64 = model.predict_prefill_s(1, sms=132), model.predict_prefill_s(64, sms=132)
    assert t64 < 1.3 * t1
    assert model.predict_prefill_s(8192, sms=132) == pytest.approx(2 * model.predict_prefill_s(4096, sms=132), rel=0.1)
    assert model.saturation_tokens(68) < model.saturation_tokens(132)
    with_overhead = PerfModel(LLAMA8B, H100_SXM, Calibration(prefill=PhaseCalibration(overhead_s=0.005)))
    assert with_overhead.saturation_tokens(68) > model.saturation_tokens(68)


def _sweep(model: PerfModel, truth: Calibration, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for sms in (16, 32, 64, 100):
        for busy in (False, True):
            for tokens in (64, 256, 1024, 4096):
                for ctx_mul in (1, 4):
                    shape = StepShape.prefill(tokens, tokens * ctx_mul)
                    lin, att = model.group_times_s(shape, sms)
                    t = truth.prefill.time_s(lin, att, busy) * (1 + rng.gauss(0, noise))
                    samples.append(Sample("prefill", shape.num_tokens, shape.num_seqs, shape.num_context_tokens,
                                          shape.num_attention_pairs, sms, busy, t))
            for batch in (1, 16, 64, 256):
                for ctx in (256, 4096):
                    shape = StepShape.decode(batch, batch * ctx)
                    lin, att = model.group_times_s(shape, sms)
                    t = truth.decode.time_s(lin, att, busy) * (1 + rng.gauss(0, noise))
                    samples.append(Sample("decode", shape.num_tokens, shape.num_seqs, shape.num_context_tokens,
                                          shape.num_attention_pairs, sms, busy, t))
    return samples


def test_calibration_fit_recovers_known_factors():
    model = PerfModel(LLAMA8B, FAKE)
    truth = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.11),
                        decode=PhaseCalibration(0.0008, 1.15, 1.4, 0.09))
    fitted = model.fit(_sweep(model, truth))
    for phase in ("prefill", "decode"):
        want, got = truth.of(phase), fitted.of(phase)
        assert got.linear == pytest.approx(want.linear, rel=0.02)
        assert got.attention == pytest.approx(want.attention, rel=0.02)
        assert got.overhead_s == pytest.approx(want.overhead_s, rel=0.05, abs=5e-5)
        assert got.corun_slowdown == pytest.approx(want.corun_slowdown, abs=0.005)


def test_a_serving_log_with_few_alone_shapes_keeps_the_base_factors_and_fits_the_corun():
    """Served steps run prefill alone only for each rate's first requests (4 shapes in the H200 log): from those the
    three base factors ran to a corner (GEMMs 4x, attention at its floor). With the served logs' rule the model's
    own factors stay and the busy steps give the co-run slowdown."""
    prior = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.01), decode=PhaseCalibration(0.0008, 1.15, 1.4, 0.09))
    truth = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.5), decode=prior.decode)
    model = PerfModel(LLAMA8B, FAKE, prior)
    served = [s for s in _sweep(model, truth, noise=0.02, seed=3) if s.phase == "prefill" and s.sms == 100]
    alone = [s for s in served if not s.other_busy and s.num_tokens in (64, 256)]  # 2 tokens x 2 contexts = 4 shapes
    busy = [s for s in served if s.other_busy]
    fitted = model.fit(alone + busy, min_alone_shapes=SERVED_MIN_ALONE_SHAPES).prefill
    assert (fitted.overhead_s, fitted.linear, fitted.attention) == (0.002, 1.3, 1.8)
    assert fitted.corun_slowdown == pytest.approx(0.5, abs=0.03)
    # off by default (a profile sweep's few shapes are clean: the seed profile has 3): the base factors are fitted
    assert PerfModel(LLAMA8B, FAKE).fit(alone + busy).prefill.linear != 1.0
    # with enough shapes run alone (8 here) the base factors are fitted as before, away from the prior's
    rich_alone = [s for s in served if not s.other_busy]
    assert len({(s.num_tokens, s.num_context_tokens) for s in rich_alone}) == 8
    rich = PerfModel(LLAMA8B, FAKE).fit(rich_alone + busy, min_alone_shapes=SERVED_MIN_ALONE_SHAPES).prefill
    assert rich.linear == pytest.approx(1.3, rel=0.05) and rich.attention == pytest.approx(1.8, rel=0.1)


def test_calibration_fit_with_noise_predicts_within_a_few_percent():
    model = PerfModel(LLAMA8B, FAKE)
    truth = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.11), decode=PhaseCalibration(0.0008, 1.15, 1.4, 0.09))
    samples = _sweep(model, truth, noise=0.03, seed=1)
    model.calibration = model.fit(samples)
    errors = relative_errors(model, _sweep(PerfModel(LLAMA8B, FAKE), truth, noise=0.0))
    assert quantile(errors, 0.5) < 0.03
    assert quantile(errors, 0.9) < 0.06


def test_online_correction_converges_and_stays_bounded():
    online = OnlineCorrection(weight=0.3, bounds=(0.5, 2.0), min_samples=3)
    assert online.factor("decode", 4) == 1.0
    for _ in range(40):
        online.observe("decode", 4, predicted_s=0.010, measured_s=0.013)
    assert online.factor("decode", 4) == pytest.approx(1.3, rel=1e-3)
    # an entry without its own samples uses the phase's average; another phase stays at 1
    assert online.factor("decode", 7) == pytest.approx(1.3, rel=1e-3)
    assert online.factor("prefill", 4) == 1.0
    online.observe("decode", 4, 0.010, 10.0)  # one wild step moves it by at most weight x (2 - 1.3)
    assert online.factor("decode", 4) == pytest.approx(1.3 + 0.3 * 0.7, rel=1e-3)
    for _ in range(100):
        online.observe("decode", 4, 0.010, 1.0)
    assert online.factor("decode", 4) == pytest.approx(2.0)


def test_model_observe_corrects_predictions_per_ladder_entry():
    model = PerfModel(LLAMA8B, FAKE)
    shape = StepShape.decode(32, 32 * 1000)
    base = model.predict(shape, 40, index=3).seconds
    errors = [model.observe(shape, 40, False, 3, measured_s=1.25 * base) for _ in range(30)]
    assert errors[0] == pytest.approx(-0.2, rel=1e-3)  # predicted 1.0 where 1.25 was measured
    assert abs(errors[-1]) < 1e-3
    assert model.predict(shape, 40, index=3).seconds == pytest.approx(1.25 * base, rel=1e-3)


def test_queue_ttft_adds_batches_and_waiting():
    model = PerfModel(LLAMA8B, FAKE)
    one = model.predict(StepShape.of_prompts([500]), 60).seconds
    two = model.predict(StepShape.of_prompts([300, 200]), 60).seconds
    finish = batches_finish_s(model, [[500], [300, 200]], 60, False, start_s=0.01)
    assert finish == pytest.approx([0.01 + one, 0.01 + one + two])
    ttft = predict_queue_ttft_s(model, [[(500, 0.2)], [(300, 0.0), (200, 0.1)]], 60, False, start_s=0.01)
    assert ttft[0][0] == pytest.approx(0.21 + one)
    assert ttft[1] == pytest.approx([finish[1], finish[1] + 0.1])
    busy = batches_finish_s(PerfModel(LLAMA8B, FAKE, Calibration(prefill=PhaseCalibration(corun_slowdown=0.5))),
                            [[500]], 60, True)
    assert busy[0] == pytest.approx(1.5 * one)


def _profile(tmp_path: Path) -> Profile:
    model = PerfModel(LLAMA8B, FAKE)
    truth = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.11), decode=PhaseCalibration(0.0008, 1.15, 1.4, 0.09))
    samples = _sweep(model, truth)
    return Profile(FAKE, {"name": "llama-3.1-8b", **model_fingerprint(LLAMA8B)}, "bfloat16", [20, 40, 60, 80],
                   model.fit(samples), samples, date="2026-11-23", command="test")


def test_profile_round_trip_and_lookup(tmp_path: Path):
    profile = _profile(tmp_path)
    path = save_profile(profile, tmp_path)
    assert path.name == "fake__llama-3-1-8b__bfloat16.json"
    back = load_profile(path)
    assert back.calibration == profile.calibration
    assert back.samples[5] == profile.samples[5]
    assert find_profile("fake", LLAMA8B, "bfloat16", [tmp_path]) is not None
    assert find_profile("fake", LLAMA8B, "float32", [tmp_path]) is None
    assert find_profile("NVIDIA H100 80GB HBM3", LLAMA8B, "bfloat16", [tmp_path]) is None
    refit = PerfModel.from_profile(back, LLAMA8B, refit=True)
    assert refit.calibration.decode.linear == pytest.approx(1.15, rel=0.02)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d.pop("gpu"), "gpu"),
    (lambda d: d.update(schema_version=99), "schema_version"),
    (lambda d: d["model"].pop("hidden_size"), "model.hidden_size"),
    (lambda d: d["samples"][0].update(phase="mixed"), "samples[0].phase"),
    (lambda d: d["samples"][1].pop("sms"), "samples[1].sms"),
    (lambda d: d["calibration"]["decode"].update(speed=2), "calibration.decode.speed"),
    (lambda d: d["gpu"].update(peak_tflops=0), "gpu.peak_tflops"),
])
def test_bad_profiles_name_the_field(tmp_path: Path, edit, field):
    d = _profile(tmp_path).to_dict()
    edit(d)
    with pytest.raises(ConfigError) as err:
        Profile.from_dict(d)
    assert err.value.field == field


@pytest.mark.parametrize("shape", [StepShape.decode(64, 64 * 1024), StepShape.prefill(2048, 4096, 2),
                                   StepShape.of_prompts([100, 900], [0, 300]), StepShape.decode(1, 5)])
def test_fast_group_times_equal_the_kernel_sums(shape):
    model = PerfModel(LLAMA8B, H100_SXM)
    for sms in (16, 64, 132):
        per_class = model.kernel_times_s(shape, sms)
        lin = sum(t for k, t in per_class.items() if k.group == "linear")
        att = sum(t for k, t in per_class.items() if k.group == "attention")
        assert model.group_times_s(shape, sms) == pytest.approx((lin, att), rel=1e-9)


def test_fast_predictions_equal_the_step_shape_path():
    model = PerfModel(LLAMA8B, H100_SXM, Calibration(PhaseCalibration(0.001, 1.2, 1.5, 0.1),
                                                     PhaseCalibration(0.0005, 1.1, 1.3, 0.05)))
    for busy in (False, True):
        assert model.predict_prefill_s(3000, 5000, 68, busy, num_seqs=3) == pytest.approx(
            model.predict(StepShape.prefill(3000, 5000, 3), 68, busy).seconds, rel=1e-9)
        assert model.predict_decode_s(48, 48 * 700, 40, busy) == pytest.approx(
            model.predict(StepShape.decode(48, 48 * 700), 40, busy).seconds, rel=1e-9)


def test_online_correction_keys_by_step_size_then_falls_back():
    online = OnlineCorrection(weight=1.0, min_samples=2)
    for _ in range(2):
        online.observe("prefill", 3, predicted_s=0.010, measured_s=0.020, size=300)  # bucket 8 (256..511)
        online.observe("prefill", 3, predicted_s=0.100, measured_s=0.110, size=4000)  # bucket 11
    assert online.factor("prefill", 3, 400) == pytest.approx(2.0)  # same entry, same bucket
    assert online.factor("prefill", 3, 4096) == pytest.approx(1.1)  # bucket 12 unseen: the phase's last
    assert online.factor("prefill", 3, 2500) == pytest.approx(1.1)  # bucket 11
    assert online.factor("prefill", 9, 260) == pytest.approx(2.0)  # another entry: the size bucket's
    assert online.factor("prefill", None, 260) == pytest.approx(2.0)
    online.observe("prefill", 9, predicted_s=0.010, measured_s=0.015, size=260)  # one sample: not yet its own
    assert online.factor("prefill", 9, 260) == pytest.approx(1.5)  # ... but the bucket (weight 1) moved
    assert online.factor("decode", 3, 300) == 1.0


def test_saturation_follows_the_online_correction_by_step_size():
    """Measured small steps far slower than calibrated (corun on the H100: a ~400-token step 1.6x, a ~3k one
    0.93x) move the saturation size up; a size never measured does not drag the best rate down."""
    model = PerfModel(LLAMA8B, H100_SXM)
    before = model.saturation_tokens(100, share=0.95, max_tokens=8192)
    for tokens, ratio in ((200, 1.7), (400, 1.6), (800, 1.3), (1600, 1.05), (3000, 0.93)):
        for _ in range(4):
            shape = StepShape.prefill(tokens)
            model.observe(shape, 100, False, 0, ratio * model.predict(shape, 100, False, None).calibrated_s)
    after = model.saturation_tokens(100, share=0.95, max_tokens=8192)
    assert after >= 1500 > before
    # 8,192 tokens were never measured (its factor falls back to the phase's); the best is over every size
    rate = {t: t / model.predict_prefill_s(t, t, 100, num_seqs=max(1, -(-t // 1024))) for t in (after, 8192)}
    assert rate[after] >= 0.95 * rate[8192]


def test_bandwidth_curve_refined_from_decode_steps():
    """Steps made on a curve that saturates at 24 SMs, a wrong probe curve (flat from 10 SMs, as the H100's
    GEMV probe read): the refinement picks the steps' curve back and predicts decode within a few percent."""
    from dataclasses import replace

    from bullet_ray.perf.model import refine_bandwidth_curve

    truth_gpu = replace(FAKE, saturation_sms=24.0, knee=2.0)
    truth = Calibration(prefill=PhaseCalibration(0.002, 1.3, 1.8, 0.11), decode=PhaseCalibration(0.0, 1.1, 1.2, 0.09))
    samples = _sweep(PerfModel(LLAMA8B, truth_gpu), truth, noise=0.01, seed=2)
    probe = replace(FAKE, saturation_sms=10.0, knee=0.5)

    def decode_error(gpu, calibration):
        model = PerfModel(LLAMA8B, gpu, calibration)
        return quantile(relative_errors(model, [s for s in samples if s.phase == "decode"]), 0.9)

    before = decode_error(probe, PerfModel(LLAMA8B, probe).fit(samples))
    gpu, calibration = refine_bandwidth_curve(LLAMA8B, probe, samples)
    assert (gpu.saturation_sms, gpu.knee) == (24.0, 2.0)
    assert decode_error(gpu, calibration) < 0.03 < before
    one_entry = [s for s in samples if s.sms == 64]  # one SM count: nothing to choose the shape from
    assert refine_bandwidth_curve(LLAMA8B, probe, one_entry)[0] == probe
