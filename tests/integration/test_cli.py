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


@pytest.mark.parametrize(("args", "prefix"), [
    (["--model", "nosuch"], "bullet-ray generate: error: --model: model 'nosuch' is not a folder"),
    (["--model", "dummy:nope"], "bullet-ray generate: error: --model: unknown preset 'nope'"),
    (["--model", "/nowhere/m.gguf"], "bullet-ray generate: error: --model: GGUF file"),
    (["--temperature", "-1"], "bullet-ray generate: error: --temperature: must be"),
    (["--top-p", "2"], "bullet-ray generate: error: --top-p:"),
    (["--max-tokens", "0"], "bullet-ray generate: error: --max-tokens:"),
    (["--max-tokens", "x"], "bullet-ray generate: error: --max-tokens: invalid int value: 'x'"),
    (["--schedule", "nope"], "bullet-ray generate: error: --schedule: invalid choice: 'nope'"),
    (["--device", "tpu"], "bullet-ray generate: error: --device: unknown device 'tpu'"),
    (["--kv-cache-gb", "0"], "bullet-ray generate: error: --kv-cache-gb:"),
])
def test_bad_argument_is_one_line_naming_the_flag(args, prefix):
    proc = _cli("generate", *args, "hi", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr  # one line, no traceback
    assert proc.stderr.startswith(prefix), proc.stderr
    assert proc.stdout == ""


def test_missing_argument_and_unknown_command_are_one_line():
    for args in (["generate"], ["nosuch"]):
        proc = _cli(*args, timeout=60)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def test_debug_env_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("BULLET_RAY_DEBUG", "1")
    proc = _cli("generate", "--model", "nosuch", "hi", timeout=60)
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("bullet-ray generate: error: --model:")


def test_help_lists_the_commands():
    proc = _cli("--help", timeout=60)
    assert proc.returncode == 0
    assert "generate" in proc.stdout


@pytest.mark.parametrize(("args", "prefix"), [
    (["--extra-body", "{x"], "bullet-ray bench: error: --extra-body: not JSON"),
    (["--extra-body", "[1]"], "bullet-ray bench: error: --extra-body: must be a JSON object"),
    (["--rate", "abc"], "bullet-ray bench: error: --rate: invalid float value: 'abc'"),
    (["--base-url", "http://127.0.0.1:1"], "bullet-ray bench: error: --base-url: cannot reach http://127.0.0.1:1"),
])
def test_bench_bad_argument_is_one_line(args, prefix):
    proc = _cli("bench", "--num-prompts", "1", "--no-progress", *args, timeout=60)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(prefix), proc.stderr
    assert "Traceback" not in proc.stderr


def test_bench_never_saves_the_api_key():
    from bullet_ray.bench.serve_bench import redact_argv

    assert redact_argv(["x", "--api-key", "sk-1", "--rate", "2", "--api-key=sk-2"]) == [
        "x", "--api-key", "<redacted>", "--rate", "2", "--api-key=<redacted>"]
