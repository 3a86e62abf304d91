"""benchmarks.gpu.partition_gemm's Triton GEMM, run in Triton's CPU interpreter (skipped where Triton is not
installed, as in CI: Triton comes with PyTorch's CUDA builds; the GPU timing is the script's own run)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def run_cpu(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_extra
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu.partition_gemm", "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=300)


def test_tiles_and_persistent_launches_equal_the_reference():
    r = run_cpu({"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "worst relative error" in r.stdout
    assert '"5x33x70_persistent3"' in r.stdout  # a shape no tile divides, with fewer programs than tiles
    assert '"tiny_llama_step_logits"' in r.stdout and '"patches_left": 0.0' in r.stdout  # the step path, restored


def test_cpu_without_the_interpreter_says_so():
    r = run_cpu({})
    assert r.returncode != 0 and "TRITON_INTERPRET=1" in r.stderr
