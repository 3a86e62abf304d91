"""benchmarks/gpu/gemm_power.py's pure parts on CPU: how each data kind is drawn, the FLOP count, the table and
the flags' errors (the timing itself runs on the GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.gpu import gemm_power


def test_each_data_kind_is_drawn_as_its_engine_draws_it():
    gen = torch.Generator().manual_seed(0)
    w = gemm_power.fill(torch, "normal", (512, 256), True, "cpu", gen).float()
    x = gemm_power.fill(torch, "normal", (64, 256), False, "cpu", gen).float()
    assert abs(float(w.std()) - 0.02) < 0.002 and abs(float(x.std()) - 1.0) < 0.05
    wu = gemm_power.fill(torch, "uniform", (512, 256), True, "cpu", gen).float()
    xu = gemm_power.fill(torch, "uniform", (64, 256), False, "cpu", gen).float()
    assert float(wu.abs().max()) <= 1e-3 and float(wu.std()) > 4e-4  # U(-1e-3, 1e-3): std 5.8e-4
    assert float(xu.abs().max()) < 6e-3 and float(xu.std()) > 1e-4  # N(0, 1) x the norm's U(-1e-3, 1e-3)
    assert not gemm_power.fill(torch, "zeros", (4, 4), True, "cpu", gen).any()
    with pytest.raises(ValueError, match="data must be one of normal, uniform, zeros"):
        gemm_power.fill(torch, "ones", (4, 4), True, "cpu", gen)


def test_flops_table_and_flags():
    assert gemm_power.layer_flops(1) == 2 * (6144 * 4096 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336)
    rows = [{"data": "normal", "tokens": 1248, "burst_ms": 0.70, "sustained_ms": 0.80, "sustained_tflops": 680.0,
             "sm_mhz_median": 1600, "watts_median": 690.0},
            {"data": "uniform", "tokens": 1248, "burst_ms": 0.68, "sustained_ms": 0.72, "sustained_tflops": 756.0,
             "sm_mhz_median": 1980, "watts_median": 540.0}]
    lines = gemm_power.table(rows).splitlines()
    assert lines[2].split("|")[6].strip() == "1.000" and lines[3].split("|")[6].strip() == "0.900"
    assert gemm_power.build_parser().parse_args(["--tokens", "1248,4224", "--data", "normal,uniform"]).tokens == \
        [1248, 4224]
    for bad in (["--tokens", "0"], ["--tokens", "a"], ["--data", "ones"]):
        with pytest.raises(SystemExit):
            gemm_power.build_parser().parse_args(bad)


def test_table_names_each_projections_kernel_per_row_count():
    kernels = {k: [f"nvjet_{k}"] for k in gemm_power.LAYER_SHAPES}
    rows = [{"data": "normal", "tokens": t, "burst_ms": 1.0, "sustained_ms": 1.2, "sustained_tflops": 600.0,
             "sm_mhz_median": None, "watts_median": None, "kernels": kernels} for t in (4216, 4224)]
    lines = gemm_power.table(rows).splitlines()
    assert lines[5] == "| rows | qkv | o | gate_up | down |"
    assert lines[7] == "| 4216 | nvjet_qkv | nvjet_o | nvjet_gate_up | nvjet_down |" and lines[8].startswith("| 4224 |")
    assert gemm_power.build_parser().parse_args(["--kernels"]).kernels
