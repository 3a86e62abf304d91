"""engine.prefill_gemm: cublaslt on the GPU (dummy SmolLM2-135M shapes, bullet schedule, green contexts where
present): the prefill worker times cuBLASLt's algorithms on each of its partitions at start, its step log's `startup`
record keeps every point, and the greedy tokens agree with PyTorch's cuBLAS (other kernels: bf16 near-ties aside).

Run: python -m pytest tests/gpu/test_lt_gemm_gpu.py -q
"""

from __future__ import annotations

import pytest

from tests.gpu.logged_run import run_logged

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 600, 1500, 17, 1000, 3])]


def _run(tmp_path, gemm: str):
    tokens, records, _ = run_logged(tmp_path / f"steps-{gemm}.jsonl", PROMPTS, 24, schedule="bullet",
                                    split_policy="slo", max_num_batched_tokens=2048, prefill_gemm=gemm)
    startup = [r for r in records if r["kind"] == "startup" and r.get("role") == "prefill"]
    return tokens, startup


def test_cublaslt_prefill_gemm_tunes_every_partition_and_agrees_with_cublas(tmp_path):
    plain, _ = _run(tmp_path, "cublas")
    routed, startup = _run(tmp_path, "cublaslt")
    assert all(len(t) == 24 for t in routed)
    assert [t[0] for t in routed] == [t[0] for t in plain]
    same = sum(a == b for r, p in zip(routed, plain) for a, b in zip(r, p))
    assert same / sum(len(p) for p in plain) >= 0.9
    report = startup[0]["prefill_gemm"]
    assert report["gemm"] == "cublaslt" and report["tokens"] == [1024, 2048]
    # every point of every partition timed F.linear and at least one algorithm (the heuristic always has one)
    assert report["points"] == len(report["choices"]) > 0
    assert all(p["candidates"] > 0 and p["base_ms"] > 0 for p in report["choices"])
    assert report["calls"]["launch_failed"] == 0
