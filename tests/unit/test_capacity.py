"""benchmarks.capacity: the ceilings from request lengths and a measured token rate."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from benchmarks import capacity

SPEED = {"peak_gemm_tflops": 800,
         "prefill": {"1024": {"tokens_per_s": 30000, "tflops": 480.0, "mfu": 0.6},
                     "4096": {"tokens_per_s": 40000, "tflops": 640.0, "mfu": 0.8}}}


def _result_dir(tmp_path, lengths_by_rate):
    runs = tmp_path / "runs"
    runs.mkdir()
    for rate, lengths in lengths_by_rate.items():
        reqs = [{"prompt_tokens_requested": p, "output_tokens_requested": o} for p, o in lengths]
        for system in ("vllm", "ours"):
            with gzip.open(runs / f"{system}-rate{rate}.json.gz", "wt") as f:
                json.dump({"requests": reqs}, f)
    goodput = {"strict": {"interpolated_rps": 12.5}}
    compare = {"config": {"workload": {"num_prompts": 2}, "rates": list(lengths_by_rate)},
               "slos": [{"name": "strict", "ttft_s": 0.5}, {"name": "per-token", "ttft_s": None}],
               "systems": {"vllm": {"goodput": goodput}, "ours": {"goodput": {}}}}
    (tmp_path / "compare.json").write_text(json.dumps(compare))
    return tmp_path


def test_ceilings_from_lengths_and_the_best_rate(tmp_path):
    d = _result_dir(tmp_path, {8: [(900, 100), (1100, 300)], 16: [(1000, 200), (1000, 200)]})
    res = capacity.analyse(d, SPEED)
    assert res["requests"] == 4 and res["mean_prompt_tokens"] == 1000 and res["mean_output_tokens"] == 200
    assert res["best_tokens_per_s"] == 40000 and res["flops_per_token"] == 16e9
    assert res["sustained_ceiling_rps"] == pytest.approx(40000 / 1200, abs=0.01)
    assert res["prefill_only_ceiling_rps"] == 40.0
    assert res["gemm_peak_prefill_only_ceiling_rps"] == 50.0  # 800 TFLOP/s / 16 GFLOP per token / 1000
    strict = res["slos"]["strict"]
    assert "per-token" not in res["slos"]  # no absolute TTFT limit: no burst ceiling
    assert strict["burst_ceiling_rps"] == pytest.approx(capacity.burst_ceiling(40.0, 2, 0.5), abs=0.01)
    assert strict["goodput_rps"] == {"vllm": 12.5}


def test_a_goodput_below_the_sweep_is_none_and_said_so(tmp_path):
    d = _result_dir(tmp_path, {8: [(900, 100), (1100, 300)]})
    compare = json.loads((d / "compare.json").read_text())
    compare["systems"]["ours"]["goodput"] = {"strict": {"interpolated_rps": None, "measured_rps": 0.0}}
    (d / "compare.json").write_text(json.dumps(compare))
    res = capacity.analyse(d, SPEED)
    assert res["slos"]["strict"]["goodput_rps"] == {"vllm": 12.5, "ours": None}
    assert "ours below the lowest rate" in capacity.report(res)


def test_burst_ceiling():
    # C = 10 req/s, 100 requests, 1 s: 1/r >= 0.1 - 1/90
    assert capacity.burst_ceiling(10.0, 100, 1.0) == pytest.approx(1 / (0.1 - 1 / 90))
    assert capacity.burst_ceiling(10.0, 5, 1.0) == math.inf  # so few requests that any rate drains in time
    assert capacity.burst_ceiling(10.0, 10**9, 1.0) == pytest.approx(10.0)


def test_missing_files_name_the_path(tmp_path, capsys):
    with pytest.raises(SystemExit):
        capacity.main([str(tmp_path), "--speed", str(tmp_path / "speed.json")])
    assert "no such file" in capsys.readouterr().err
