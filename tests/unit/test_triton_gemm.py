"""engine.prefill_gemm: the config's errors (always), and the Triton GEMM routed into a model (where Triton is
installed: its CPU interpreter, in a child process so TRITON_INTERPRET is set before Triton loads)."""

import os
import subprocess
import sys
import textwrap

import pytest

from bullet_ray.config import EngineConfig
from bullet_ray.errors import ConfigError
from bullet_ray.serve.config import EngineArgs


def test_prefill_gemm_config_names_the_field():
    assert EngineConfig().prefill_gemm == "cublas"
    assert EngineConfig(device="cuda", schedule="bullet", prefill_gemm="triton").prefill_gemm == "triton"
    with pytest.raises(ConfigError, match="prefill_gemm.*cublas or triton"):
        EngineConfig(prefill_gemm="cutlass")
    # the prefill worker's GEMM: no such worker in the chunked schedule, and no partition on CPU
    with pytest.raises(ConfigError, match="prefill_gemm.*schedule chunked"):
        EngineConfig(device="cuda", schedule="chunked", prefill_gemm="triton")
    with pytest.raises(ConfigError, match="prefill_gemm.*device cpu"):
        EngineConfig(schedule="bullet", prefill_gemm="triton")
    with pytest.raises(ValueError, match="prefill_gemm"):
        EngineArgs(prefill_gemm="cutlass")


ROUTED = textwrap.dedent("""
    import json, torch
    from bullet_ray.engine import triton_gemm
    from bullet_ray.models.layers import linear_into
    from bullet_ray.perf.sweep import Bench

    bench = Bench("dummy:tiny-llama", "cpu", "float32", use_graphs=False)
    model, out = bench.model, {}
    fn = bench.step_fn(bench.batch(2, 20, 0), 0)
    plain = fn()
    attn = model.model.layers[0].self_attn
    x = torch.randn(7, attn.qkv_proj.in_features)
    buf_plain = torch.zeros(7, attn.qkv_proj.out_features)
    linear_into(attn.qkv_proj, x, buf_plain)
    undo = triton_gemm.route_projections(model, "16x32x16s1w1")
    routed = fn()
    buf = torch.zeros(7, attn.qkv_proj.out_features)
    linear_into(attn.qkv_proj, x, buf)  # the CUDA-graph buffer path: into `buf`, through the Triton GEMM
    try:
        triton_gemm.route_projections(model, "16x32x16s1w1")
    except ValueError as e:
        out["twice"] = str(e)
    out["routed"] = sorted(n for n, m in model.named_modules() if "gemm_into" in m.__dict__)[:3]
    undo()
    out["left"] = sum("gemm_into" in m.__dict__ or "forward" in m.__dict__ for m in model.modules())
    out["step_err"] = float((routed - plain).abs().max() / plain.abs().max())
    out["into_err"] = float((buf - buf_plain).abs().max() / buf_plain.abs().max())
    print(json.dumps(out))
""")


def test_routed_projections_match_cublas_and_undo():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", ROUTED], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["step_err"] < 1e-5 and out["into_err"] < 1e-5
    assert out["routed"] == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.o_proj",
                             "model.layers.0.self_attn.qkv_proj"]
    assert "routed already" in out["twice"]
    assert out["left"] == 0


def test_tile_config_from_the_environment(monkeypatch):
    triton_gemm = pytest.importorskip("bullet_ray.engine.triton_gemm")
    monkeypatch.delenv(triton_gemm.CONFIG_ENV, raising=False)
    assert triton_gemm.config_from_env() == triton_gemm.DEFAULT_CONFIG
    monkeypatch.setenv(triton_gemm.CONFIG_ENV, "128x128x64s4w8")
    assert triton_gemm.config_from_env() == "128x128x64s4w8"
    monkeypatch.setenv(triton_gemm.CONFIG_ENV, "64x64")
    with pytest.raises(ValueError, match="BULLET_RAY_TRITON_GEMM_CONFIG='64x64'"):
        triton_gemm.config_from_env()


def test_prefill_gemm_triton_needs_16_bit_weights():
    assert EngineConfig(device="cuda", dtype="float16", prefill_gemm="triton").prefill_gemm == "triton"
    with pytest.raises(ConfigError, match="prefill_gemm.*not float32"):
        EngineConfig(device="cuda", dtype="float32", prefill_gemm="triton")


def test_a_model_with_biased_projections_is_refused_by_name():
    triton_gemm = pytest.importorskip("bullet_ray.engine.triton_gemm")
    from bullet_ray.models.loader import load_model

    model = load_model("dummy:tiny-qwen2", device="cpu").model  # qkv with a bias
    with pytest.raises(ValueError, match="bias"):
        triton_gemm.route_projections(model, "16x32x16s1w1")
    assert not any("gemm_into" in m.__dict__ for m in model.modules())  # nothing half-routed
    with pytest.raises(ValueError, match="tile config"):
        triton_gemm.route_projections(model, "64x64")
