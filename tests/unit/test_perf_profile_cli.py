"""`bullet-ray profile --device cpu` on a tiny model writes a profile the engine finds; the shipped profiles
load and match their device and model; a device without one falls back to the roofline with a warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bullet_ray.cli import build_parser
from bullet_ray.models.config import ModelConfig
from bullet_ray.perf import profile_cli
from bullet_ray.perf.loading import load_perf_model
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import PACKAGE_DIR, find_profile, load_profile

PRESETS = Path(__file__).resolve().parents[2] / "bullet_ray" / "models" / "presets"


def _cfg(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict(json.loads((PRESETS / f"{name}.json").read_text()))


def test_cpu_profile_sweep_writes_a_profile_the_engine_finds(tmp_path: Path):
    args = build_parser().parse_args(["profile", "--model", "dummy:tiny-llama", "--device", "cpu", "--quick",
                                      "--out", str(tmp_path)])
    assert profile_cli.run(args) == 0
    path = tmp_path / "cpu__tiny-llama__float32.json"
    profile = load_profile(path)
    assert profile.source == "measured" and profile.gpu.sm_count == 1 and profile.ladder == [1]
    assert {s.phase for s in profile.samples} == {"prefill", "decode"}
    assert all(s.measured_s > 0 and not s.other_busy for s in profile.samples)
    assert profile.fit["num_samples"] == len(profile.samples)
    # the command from the parsed arguments (not sys.argv, which is pytest's here)
    assert profile.command.startswith("bullet-ray profile --model dummy:tiny-llama") and "--quick" in profile.command
    assert "--device cpu" in profile.command and "test_perf_profile_cli.py" not in profile.command
    assert find_profile("cpu", _cfg("tiny-llama"), "float32", [tmp_path]) is not None
    model = PerfModel.from_profile(profile, _cfg("tiny-llama"))
    assert model.predict_prefill_s(64, sms=1) > 0


def test_prefill_gemm_on_cpu_is_a_one_line_error(tmp_path: Path, capsys):
    """--prefill-gemm cublaslt profiles with the engine's tuned cuBLASLt GEMMs on a GPU; on a CPU it is refused with
    one line naming the flag (exit 2), before any model loads."""
    args = build_parser().parse_args(["profile", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--prefill-gemm", "cublaslt", "--out", str(tmp_path)])
    assert profile_cli.run(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("bullet-ray profile: --prefill-gemm: cublaslt runs bf16 cuBLASLt GEMMs on a GPU")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value,why", [("8,16", "the split ladder is a GPU's (device cpu has none)")])
def test_a_ladder_on_cpu_is_a_one_line_error(tmp_path: Path, capsys, value: str, why: str):
    """--decode-sm-counts sweeps the ladder a deployment serves with (engine.decode_sm_counts) on a GPU; on a CPU it
    is refused with one line naming the flag (exit 2), before any model loads."""
    args = build_parser().parse_args(["profile", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--decode-sm-counts", value, "--out", str(tmp_path)])
    assert profile_cli.run(args) == 2
    assert capsys.readouterr().err == f"bullet-ray profile: --decode-sm-counts: {why}\n"
    assert not list(tmp_path.iterdir())


def test_shipped_profiles_load_and_match():
    h100 = find_profile("NVIDIA H100 80GB HBM3", _cfg("llama-3.1-8b"), "bfloat16", [PACKAGE_DIR])
    # the H100 sweep of 2026-11-26 (11 of 13 ladder entries, 726 steps), refitted (benchmarks.refit_profile); the
    # refit with the other two entries served worse (benchmarks/results/profile_h100_m2n) and is not shipped
    assert h100 is not None and h100.gpu.sm_count == 132 and h100.source == "measured"
    assert len(h100.samples) == 726 and len({s.sms for s in h100.samples if s.phase == "decode"}) == 11
    assert 0 < h100.calibration.decode.corun_slowdown < 0.5
    assert h100.fit["decode"]["median_rel_error"] < 0.1 and h100.fit["prefill"]["median_rel_error"] < 0.1
    model = PerfModel.from_profile(h100, _cfg("llama-3.1-8b"))
    # a decode step at batch 64, context 1024 on the whole GPU (not a ladder entry: no sample), measured apart
    # by engine_speed: 10.9 ms (graphs, host plan; gpu_engine_speed_h100.json); the profile predicts 11.9 ms
    assert model.predict_decode_s(64, 64 * 1024, 132) == pytest.approx(0.01094, rel=0.12)
    assert find_profile("cpu", _cfg("tiny-llama"), "float32", [PACKAGE_DIR]) is not None
    for path in PACKAGE_DIR.glob("*.json"):
        profile = load_profile(path)
        assert bool(profile.samples) == (profile.source == "measured")  # a derived one holds no steps of its GPU


def test_the_derived_h200_profile_is_the_h100s_with_faster_memory(tmp_path: Path):
    """benchmarks.derive_profile: how an H200 got a profile before one was measured there (it shipped until the
    thirty-sixth session; benchmarks/results/derived_h200_profile/ keeps that file)."""
    from benchmarks.derive_profile import main as derive_main

    cfg = _cfg("llama-3.1-8b")
    h100 = find_profile("NVIDIA H100 80GB HBM3", cfg, "bfloat16", [PACKAGE_DIR])
    assert h100 is not None
    assert derive_main([str(PACKAGE_DIR / h100.file_name), "--gpu-name", "NVIDIA H200", "--bandwidth-scale", "1.433",
                        "--out", str(tmp_path)]) == 0
    h200 = find_profile("NVIDIA H200", cfg, "bfloat16", [tmp_path])
    assert h200 is not None and h200.source == "derived" and not h200.samples and "derive_profile" in h200.command
    assert h200.calibration == h100.calibration and h200.ladder == h100.ladder
    # the file that shipped is what the script makes from the H100's
    kept = load_profile(Path(__file__).parents[2] / "benchmarks/results/derived_h200_profile" / h200.file_name)
    assert kept.gpu == h200.gpu and kept.calibration == h200.calibration and kept.source == "derived"
    old, new = PerfModel.from_profile(h100, cfg), PerfModel.from_profile(h200, cfg)
    # decode (weights streamed) gains up to the bandwidth's 1.43x, more the more SMs it has (an SM pulls no more bytes
    # per second on the H200); a long prefill (matrix-bound) stays within a few percent
    gains = [old.predict_decode_s(64, 64 * 1024, n) / new.predict_decode_s(64, 64 * 1024, n) for n in (16, 32, 64, 132)]
    assert gains == sorted(gains) and gains[0] > 1.0 and 1.3 < gains[-1] < 1.45
    for sms in (32, 64, 104):
        assert old.predict_prefill_s(4096, sms=sms) / new.predict_prefill_s(4096, sms=sms) == pytest.approx(1, abs=0.05)
    assert derive_main([str(tmp_path / "nope.json"), "--gpu-name", "x", "--bandwidth-scale", "1",
                        "--out", str(tmp_path)]) == 2
    assert derive_main([str(PACKAGE_DIR / h100.file_name), "--gpu-name", "x", "--bandwidth-scale", "0",
                        "--out", str(tmp_path)]) == 2


def test_an_h200_loads_the_profile_measured_there():
    """The shipped H200 profile is `bullet-ray profile`'s sweep on an H200 (2026-11-30, five ladder entries, 340
    steps; benchmarks/results/serve_h200_m11/), and a worker on an H200 (the device name torch reports) loads it."""
    cfg = _cfg("llama-3.1-8b")
    h200 = find_profile("NVIDIA H200", cfg, "bfloat16", [PACKAGE_DIR])
    assert h200 is not None and h200.source == "measured" and len(h200.samples) == 340
    assert h200.gpu.name == "NVIDIA H200" and h200.gpu.sm_count == 132
    # the prefill side runs a few percent slower beside a busy decode, decode more beside a busy prefill
    assert 0 < h200.calibration.prefill.corun_slowdown < h200.calibration.decode.corun_slowdown < 0.15
    assert h200.fit["prefill"]["median_rel_error"] < 0.1 and h200.fit["decode"]["median_rel_error"] < 0.1
    model, source = load_perf_model("NVIDIA H200", 132, cfg, "bfloat16")
    assert source == f"{h200.file_name} (measured, {h200.date})" and model.gpu == h200.gpu


def test_no_profile_falls_back_to_the_roofline_with_a_warning(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("BULLET_RAY_PROFILE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="bullet_ray.perf.loading"):
        model, source = load_perf_model("NVIDIA A100-SXM4-80GB", 108, _cfg("llama-3.1-8b"), "bfloat16")
    assert source == "roofline defaults" and model.gpu.sm_count == 108
    assert "no performance profile" in caplog.text
    model, source = load_perf_model("NVIDIA H100 80GB HBM3", 132, _cfg("llama-3.1-8b"), "bfloat16")
    assert source.startswith("nvidia-h100")


def test_sweep_entry_runs_the_busy_path_on_cpu():
    """The GPU sweep's loop (alone, then with the other side's steps queued first) on the CPU, where
    'streams' are None and the other side's steps simply run before the timed one: checks the code path."""
    from types import SimpleNamespace

    from bullet_ray.perf.profile_cli import _sweep_entry
    from bullet_ray.perf.sweep import Bench, SweepPlan, decode_points, prefill_points

    bench = Bench("dummy:tiny-llama", "cpu", "float32", use_graphs=False)
    plan = SweepPlan((8,), (0,), 64, (2,), (16,), (False, True), repeats=1, warmup=0)
    bar = SimpleNamespace(update=lambda n: None)
    samples = _sweep_entry(bench, plan, None, 0, None, prefill_points(plan, bench.capacity_tokens),
                           decode_points(plan, bench.capacity_tokens), bar)
    assert [(s.phase, s.other_busy) for s in samples] == [("prefill", False), ("decode", False),
                                                          ("prefill", True), ("decode", True)]
    assert all(s.measured_s > 0 and s.sms == 1 for s in samples)


@pytest.mark.gpu
def test_gpu_quick_profile_on_two_entries(tmp_path: Path):
    """On a GPU: the quick sweep of a tiny model on two ladder entries, alone and busy, writes a profile whose
    samples cover both sides and SM counts (the H100 run of the full sweep is benchmarks/gpu/profile_h100.py)."""
    hf = json.loads((PRESETS / "tiny-llama.json").read_text())
    hf.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128,  # flashinfer's sizes
              max_position_embeddings=8192)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    out = tmp_path / "out"
    args = build_parser().parse_args(["profile", "--model", f"dummy:{tmp_path / 'config.json'}", "--device", "cuda",
                                      "--quick", "--entries", "0,6", "--out", str(out)])
    assert profile_cli.run(args) == 0
    profile = load_profile(next(out.glob("*.json")))
    assert profile.gpu.sm_count > 1 and profile.gpu.saturation_sms > 0
    assert {(s.phase, s.other_busy) for s in profile.samples} == {
        ("prefill", False), ("prefill", True), ("decode", False), ("decode", True)}
    assert len({s.sms for s in profile.samples if s.phase == "decode"}) == 2
    # a configured ladder (engine.decode_sm_counts) is the one swept: its floor's decode steps measured
    floor = tmp_path / "floor"
    args = build_parser().parse_args(["profile", "--model", f"dummy:{tmp_path / 'config.json'}", "--device", "cuda",
                                      "--quick", "--decode-sm-counts", "8,64", "--entries", "0", "--out", str(floor)])
    assert profile_cli.run(args) == 0
    profile = load_profile(next(floor.glob("*.json")))
    assert profile.ladder == [8, 64] and {s.sms for s in profile.samples if s.phase == "decode"} == {8}
