"""benchmarks.gpu.lt_algos' pure pieces, without CUDA: the ctypes layouts, F.linear's column-major description, the
algorithm description and dedupe, finding libcublasLt in /proc/self/maps, --help and the --enumerate flags."""

import ctypes

import pytest

from benchmarks.gpu import lt_algos
from bullet_ray.gpu import cublaslt, cublaslt_ids


def test_struct_sizes_match_the_header():
    assert ctypes.sizeof(cublaslt.MatmulAlgo) == 64  # uint64_t data[8]
    assert ctypes.sizeof(cublaslt.HeuristicResult) == 96  # algo, size_t, status, float, int[4]
    assert cublaslt.HeuristicResult.workspaceSize.offset == 64
    assert cublaslt.HeuristicResult.state.offset == 72 and cublaslt.HeuristicResult.wavesCount.offset == 76


def test_linear_layout_is_the_column_major_transpose():
    # y [m, n] = x [m, k] @ w [n, k]^T  <=>  y^T (n x m, ld n) = (w as k x n)^T (x as k x m)
    lay = cublaslt.linear_layout(m=2048, n=6144, k=4096)
    assert lay.a == (4096, 6144, 4096) and lay.trans_a == cublaslt.CUBLAS_OP_T
    assert lay.b == (4096, 2048, 4096) and lay.trans_b == cublaslt.CUBLAS_OP_N
    assert lay.d == (6144, 2048, 6144)


def test_enum_names_follow_the_header():
    assert cublaslt_ids.TILE_NAMES[24] == "256x128" and cublaslt_ids.TILE_NAMES[20] == "128x128"
    assert cublaslt_ids.TILE_NAMES[35] == "256x32" and cublaslt_ids.TILE_NAMES[513] == "256x256"
    assert cublaslt_ids.STAGES_NAMES[16] == "64x4" and cublaslt_ids.STAGES_NAMES[24] == "128x6"
    assert cublaslt_ids.STAGES_NAMES[31] == "8x3" and 29 not in cublaslt_ids.STAGES_NAMES
    assert cublaslt_ids.CLUSTER_NAMES[0] == "auto" and 1 not in cublaslt_ids.CLUSTER_NAMES
    assert cublaslt_ids.CLUSTER_NAMES[5] == "1x2x1" and cublaslt_ids.CLUSTER_NAMES[9] == "2x4x1"
    assert cublaslt_ids.CLUSTER_NAMES[51] == "1x15x1"


def test_decode_algo_reads_every_attribute_and_labels_it():
    values = {0: 66, 1: 24, 2: 1, 3: 0, 4: 0, 5: 0, 6: 16, 7: 0, 8: 5}  # attribute -> value
    seen_types = {}

    def get(attr, ctype):
        seen_types[attr] = ctype
        return values[attr]

    config = cublaslt.decode_algo(get)
    assert config.tile_id == 24 and config.cluster_shape_id == 5
    assert seen_types[7] is ctypes.c_uint16 and seen_types[8] is ctypes.c_uint16 and seen_types[2] is ctypes.c_int32
    assert config.label == "algo66 tile 256x128 stages 64x4 cluster 1x2x1 splitK 1"


def test_label_of_split_k_unknown_ids_and_refused_attributes():
    config = cublaslt.decode_algo(lambda attr, ctype: {1: 999, 2: 4, 3: 2, 4: 1, 5: 3}.get(attr, 0))
    assert config.label == "algo0 tile #999 stages undefined cluster auto splitK 4 (compute_type) swz1 opt3"
    refused = cublaslt.decode_algo(lambda attr, ctype: None if attr == 8 else 1)
    assert refused.cluster_shape_id is None and "cluster ?" in refused.label


def _result(words: list[int], waves: float = 1.0) -> cublaslt.HeuristicResult:
    r = cublaslt.HeuristicResult()
    for i, w in enumerate(words):
        r.algo.data[i] = w
    r.wavesCount = waves
    return r


def test_dedupe_keeps_the_first_of_identical_algos_with_its_rank():
    a, b = _result([1, 2, 3]), _result([1, 2, 4])
    same_as_a = _result([1, 2, 3], waves=2.0)
    kept = cublaslt.dedupe([a, b, same_as_a, b])
    assert [rank for rank, _ in kept] == [0, 1]
    assert kept[0][1].wavesCount == 1.0
    assert cublaslt.algo_key(a.algo) == cublaslt.algo_key(same_as_a.algo) and len(cublaslt.algo_key(a.algo)) == 64


def test_cublaslt_path_from_maps():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n"
        "7f02-7f03 r--p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 456 /venv/nvidia/cu13/lib/libcublasLt.so.13\n"
        "7f06-7f07 r-xp 00000000 08:01 789 /venv/nvidia/cu13/lib/libcublas.so.13\n"
    )
    assert cublaslt.cublaslt_path_from_maps(maps) == "/venv/nvidia/cu13/lib/libcublasLt.so.13"
    assert cublaslt.cublaslt_path_from_maps(maps.replace("libcublasLt", "libother")) is None


def test_error_names_the_call_and_status():
    with pytest.raises(cublaslt.CublasLtError, match=r"cublasLtMatmul failed: CUBLAS_STATUS_NOT_SUPPORTED \(15\)"):
        cublaslt.check(15, "cublasLtMatmul")
    cublaslt.check(0, "cublasLtMatmul")


def test_help_exits_zero(capsys):
    with pytest.raises(SystemExit) as exit_info:
        lt_algos.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--decode-sms" in out and "--green-whole" in out and "--max-workspace-mib" in out
    assert "--enumerate" in out and "--max-candidates" in out and "--min-tile" in out


def test_enumeration_bounds_from_the_flags_and_an_unknown_cluster(capsys):
    import argparse

    args = argparse.Namespace(clusters="auto,1x2x1", min_tile=128, max_stages=2, max_checks=50, splitk="1,4",
                              custom_options=0)
    bounds = lt_algos.enumeration_bounds(args)
    assert bounds.cluster_shape_ids == (0, 5) and bounds.splitk_nums == (1, 4) and bounds.min_tile == 128
    with pytest.raises(SystemExit) as exit_info:
        lt_algos.main(["--enumerate", "--clusters", "1x1x1,3x3x3"])
    assert exit_info.value.code == 2 and "unknown 3x3x3" in capsys.readouterr().err


def test_module_imports_no_torch_at_import_time():
    import subprocess
    import sys

    code = "import sys, benchmarks.gpu.lt_algos; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_routed_step_runs_the_chosen_projections_through_the_engines_router_and_undoes_it(monkeypatch):
    """On CPU (bf16), with test_lt_gemm's fake cuBLASLt: the routed step's logits match the plain step's, only the
    projections whose best beat F.linear are launched (with their own algorithm), and every module has its own
    forward back."""
    import torch

    from bullet_ray.perf.sweep import Bench
    from tests.unit.test_lt_gemm import FakeLt

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)  # on_stream's wait, without CUDA
    bench = Bench("dummy:tiny-llama", "cpu", "bfloat16", use_graphs=False)
    layer = bench.model.model.layers[0]
    shapes = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
              "down": layer.mlp.down_proj}
    fake = FakeLt()
    rows = []
    for tag, (proj, speed) in enumerate((("qkv", 1.3), ("o", 0.9), ("gate_up", 1.1), ("down", None)), start=1):
        n, k = shapes[proj].weight.shape
        best = {"label": f"algo{tag}", "source": "heuristic", "sm_target": 0, "rank": 0, "ms": 1.0, "tflops": 1.0,
                "algo_hex": (bytes([1 if tag == 1 else 2]) + bytes(63)).hex()}
        rows.append({"place": "whole", "sms": 132, "tokens": 24, "proj": proj, "n": n, "k": k, "best": best,
                     "f_linear": {"ms": 1.3}, "best_over_f_linear": speed})
    out = lt_algos.routed_step(bench, rows, None, 2, fake.lib())
    layers = len(bench.model.model.layers)
    assert out["routed_projs"] == ["gate_up", "qkv"] and out["logits_rel_err"] < 0.02
    assert out["router_calls"]["routed"] > 0 and out["router_calls"]["routed"] % (2 * layers) == 0
    assert {tag for tag, rows_, _ in fake.launches} == {1, 2} and {r for _, r, _ in fake.launches} == {24}
    assert not any("forward" in m.__dict__ for m in bench.model.modules())


def test_cluster_variants_are_new_checked_algorithms():
    """Each source algorithm with 1x1 / 1x2 / 2x1 clusters: a variant the check refuses, one over the workspace or one
    already known is left out."""
    from tests.unit.test_cublaslt import FakeLt

    lib = FakeLt()
    gemm = cublaslt.LinearGemm(lib, ctypes.c_void_p(), 2048, 6144, 4096)  # type: ignore[arg-type]
    sources = []
    for tile in (24, 20):  # FakeLt's check accepts tile 24 only, and asks 2 MiB of workspace of 2x1x1 clusters
        r = cublaslt.HeuristicResult()
        r.algo.data[0], r.algo.data[1] = 66, tile
        sources.append(r)
    known_variant = cublaslt.with_settings(lib, sources[0].algo, [(8, cublaslt_ids.CLUSTER_IDS["1x1x1"])])
    out = lt_algos.cluster_variants(lib, gemm, sources, {cublaslt.algo_key(known_variant)}, 1 << 20)
    assert [(source, rank, r.algo.data[1], r.algo.data[7]) for source, rank, r in out] == [
        ("cluster_variant", 0, 24, cublaslt_ids.CLUSTER_IDS["1x2x1"])]


def test_engine_speed_takes_the_prefill_gemm_flag(capsys):
    """benchmarks.gpu.engine_speed --prefill-gemm (the engine_speed call of a lease with cuBLASLt's tuned GEMMs):
    --help names it; an unknown GEMM is a one-line error, exit 2."""
    from benchmarks.gpu import engine_speed

    with pytest.raises(SystemExit) as done:
        engine_speed.main(["--help"])
    assert done.value.code == 0 and "--prefill-gemm" in capsys.readouterr().out
    with pytest.raises(SystemExit) as bad:
        engine_speed.main(["--prefill-gemm", "triton"])
    assert bad.value.code == 2 and "--prefill-gemm" in capsys.readouterr().err
