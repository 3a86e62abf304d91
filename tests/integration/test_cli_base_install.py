"""A base install (no extras: no ray, fastapi, aiohttp, matplotlib) runs `bullet-ray generate` and `doctor`;
`bullet-ray bench` says which extra to install.

The extras' packages are made unimportable in the CLI process and every process it starts through a
`sitecustomize` that sets them to None in sys.modules (so `import ray` fails and
`importlib.util.find_spec("ray")` answers None, as on a machine without them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTRAS_MODULES = ("ray", "fastapi", "starlette", "uvicorn", "aiohttp", "matplotlib", "grpc", "prometheus_client")

_SITECUSTOMIZE = f"""
import sys
for _name in {EXTRAS_MODULES!r}:
    sys.modules[_name] = None  # import fails, find_spec answers None
"""


@pytest.fixture()
def base_env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.pop("BULLET_RAY_DEBUG", None)
    return env


def _cli(env: dict[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bullet_ray.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_the_extras_are_really_blocked(base_env):
    for module in ("ray", "fastapi", "aiohttp", "matplotlib"):
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                              env=base_env, timeout=60)
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, module


@pytest.mark.slow
def test_generate_runs_without_extras(base_env):
    proc = _cli(base_env, "generate", "--schedule", "chunked", "--max-tokens", "4", "Hello")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()


def test_doctor_runs_without_extras(base_env):
    proc = _cli(base_env, "doctor", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SM-partition capabilities" in proc.stdout


def test_bench_without_extra_says_which_extra(base_env):
    help_proc = _cli(base_env, "bench", "--help", timeout=60)
    assert help_proc.returncode == 0 and "--base-url" in help_proc.stdout
    proc = _cli(base_env, "bench", "--num-prompts", "1", timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("bullet-ray bench needs the bench extra: pip install 'bullet-ray[bench]'")


def test_benchmarks_aliases_are_the_package_modules():
    import benchmarks.compare
    import benchmarks.serve_bench
    import benchmarks.traces
    import bullet_ray.bench.compare
    import bullet_ray.bench.serve_bench
    import bullet_ray.bench.traces

    assert benchmarks.serve_bench is bullet_ray.bench.serve_bench
    assert benchmarks.traces is bullet_ray.bench.traces
    assert benchmarks.compare.run_comparison is bullet_ray.bench.compare.run_comparison
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serve_bench", "--help"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0 and "--base-url" in proc.stdout
