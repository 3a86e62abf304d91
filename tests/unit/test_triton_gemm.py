"""benchmarks/gpu/triton_gemm: the Triton GEMM routed into a model (where Triton is installed: its CPU interpreter,
in a child process so TRITON_INTERPRET is set before Triton loads). The engine no longer runs it
(engine.prefill_gemm was removed: it lost to cuBLAS everywhere, benchmarks/results/partition_gemm_h200/)."""

import os
import subprocess
import sys
import textwrap

import pytest

ROUTED = textwrap.dedent("""
    import json, torch
    from benchmarks.gpu import triton_gemm
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


def test_a_model_with_biased_projections_is_refused_by_name():
    pytest.importorskip("triton")
    from benchmarks.gpu import triton_gemm
    from bullet_ray.models.loader import load_model

    model = load_model("dummy:tiny-qwen2", device="cpu").model  # qkv with a bias
    with pytest.raises(ValueError, match="bias"):
        triton_gemm.route_projections(model, "16x32x16s1w1")
    assert not any("gemm_into" in m.__dict__ for m in model.modules())  # nothing half-routed
    with pytest.raises(ValueError, match="tile config"):
        triton_gemm.route_projections(model, "64x64")
