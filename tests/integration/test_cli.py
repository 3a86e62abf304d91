"""The `bullet-ray` command line: generate with the embedded model, and clear errors for bad flags."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bullet_ray.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_generate_answers_the_chat_question():
    proc = _cli("generate", "--chat", "--max-tokens", "16", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("The capital of France is Paris.")
    assert "loading" in proc.stderr


def test_bad_flag_names_the_field():
    proc = _cli("generate", "--temperature", "-1", "hi", timeout=60)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr
    proc = _cli("generate", "--schedule", "nope", "hi", timeout=60)
    assert proc.returncode == 2 and "schedule" in proc.stderr


def test_help_lists_the_commands():
    proc = _cli("--help", timeout=60)
    assert proc.returncode == 0
    assert "generate" in proc.stdout
