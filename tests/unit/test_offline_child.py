"""benchmarks.offline.run_child: the vLLM child runner of offline and kernel_compare (its result line, its
failure, and its whole process group killed on timeout)."""

from __future__ import annotations

import os
import sys
import time

from benchmarks.offline import run_child


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_result_line_is_parsed(tmp_path):
    got = run_child(_python('print("noise"); print("R {\\"rps\\": 2.5}")'), dict(os.environ), tmp_path / "c.log",
                    30, "R ")
    assert got["rps"] == 2.5 and got["child_s"] >= 0


def test_a_failed_child_reports_its_code_and_stderr(tmp_path):
    got = run_child(_python('import sys; sys.stderr.write("boom\\n"); sys.exit(3)'), dict(os.environ),
                    tmp_path / "c.log", 30, "R ")
    assert "rc 3" in got["error"] and "boom" in got["stderr_tail"]


def test_a_child_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    code = ("import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    started = time.perf_counter()
    got = run_child(_python(code), dict(os.environ), tmp_path / "c.log", 2, "R ")
    assert "timed out" in got["error"] and time.perf_counter() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.perf_counter() + 10
    while _alive(grandchild) and time.perf_counter() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the grandchild outlived the child's timeout"


def _alive(pid: int) -> bool:
    """Running (a zombie no one has reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _fake_run(monkeypatch, vllm):
    import benchmarks.offline as offline

    monkeypatch.setattr(offline, "run_ours", lambda args: {"requests_per_s": 19.0, "output_tokens_per_s": 4000.0})
    monkeypatch.setattr(offline, "_vllm_in_child", vllm)
    monkeypatch.setattr(offline, "device_info", lambda: {"name": "test"})
    return offline


def test_ours_is_saved_before_vllm_runs_and_kept_if_the_run_is_stopped(tmp_path, monkeypatch):
    """A device call's `timeout` can stop the run while vLLM's child still loads: the file already holds ours,
    and vLLM's entry says it did not finish."""
    import json

    import pytest

    out = tmp_path / "o.json"

    def stopped(*_args):
        assert json.loads(out.read_text())["ours"]["requests_per_s"] == 19.0  # written before the child starts
        raise KeyboardInterrupt

    offline = _fake_run(monkeypatch, stopped)
    with pytest.raises(KeyboardInterrupt):
        offline.main(["--vllm", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["ours"]["requests_per_s"] == 19.0 and "not finished" in saved["vllm"]["error"]
    assert not list(tmp_path.glob("*.tmp"))


def test_a_finished_run_saves_both_and_their_ratio(tmp_path, monkeypatch):
    import json

    out = tmp_path / "o.json"
    offline = _fake_run(monkeypatch, lambda *_a: {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0})
    assert offline.main(["--vllm", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert saved["vllm"]["requests_per_s"] == 20.0
    assert saved["ours_over_vllm"] == {"requests_per_s": 0.95, "output_tokens_per_s": 1.0}


def test_prefill_gemm_variants_run_ours_once_each_beside_vllm(tmp_path, monkeypatch, capsys):
    """--prefill-gemm cublas,cublaslt: our engine once per GEMM ('ours', 'ours_cublaslt'), each over vLLM; an unknown
    GEMM is a one-line error naming the flag."""
    import json

    import pytest

    out = tmp_path / "o.json"
    offline = _fake_run(monkeypatch, lambda *_a: {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0})
    gemms = []
    monkeypatch.setattr(offline, "run_ours", lambda args: gemms.append(offline.engine_config(args).prefill_gemm)
                        or {"requests_per_s": 19.0 + len(gemms), "output_tokens_per_s": 4000.0})
    assert offline.main(["--vllm", "--device", "cuda", "--prefill-gemm", "cublas,cublaslt", "--out", str(out)]) == 0
    saved = json.loads(out.read_text())
    assert gemms == ["cublas", "cublaslt"]
    assert saved["ours_over_vllm"]["requests_per_s"] == 1.0 and saved["ours_cublaslt_over_vllm"]["requests_per_s"] == 1.05
    with pytest.raises(SystemExit) as exc:
        offline.parse_args(["--prefill-gemm", "cublas,triton"])
    assert exc.value.code == 2 and "--prefill-gemm" in capsys.readouterr().err


def test_prefill_attention_variants_run_ours_under_each_mode(tmp_path, monkeypatch, capsys):
    """--prefill-attention paged,ragged: our engine once per mode ('ours', 'ours_ragged'), each built under its
    BULLET_RAY_PREFILL_ATTENTION, the variable as it was afterwards; without the flag the environment's mode; an unknown
    mode names the flag."""
    import json
    import os

    import pytest

    out = tmp_path / "o.json"
    offline = _fake_run(monkeypatch, lambda *_a: {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0})
    seen = []
    monkeypatch.setattr(offline, "run_ours", lambda args: seen.append(os.environ["BULLET_RAY_PREFILL_ATTENTION"])
                        or {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0})
    monkeypatch.delenv("BULLET_RAY_PREFILL_ATTENTION", raising=False)
    assert offline.main(["--vllm", "--prefill-attention", "paged,ragged", "--out", str(out)]) == 0
    assert seen == ["paged", "ragged"] and "BULLET_RAY_PREFILL_ATTENTION" not in os.environ
    assert json.loads(out.read_text())["ours_ragged_over_vllm"]["requests_per_s"] == 1.0
    seen.clear()  # without the flag the caller's environment stands
    monkeypatch.setenv("BULLET_RAY_PREFILL_ATTENTION", "ragged")
    assert offline.main(["--out", str(out)]) == 0 and seen == ["ragged"]
    with pytest.raises(SystemExit) as exc:
        offline.parse_args(["--prefill-attention", "paged,varlen"])
    assert exc.value.code == 2 and "--prefill-attention" in capsys.readouterr().err


def test_dummy_init_variants_draw_ours_weights_each_way(tmp_path, monkeypatch, capsys):
    """--dummy-init normal,uniform: our engine once per way of drawing dummy weights ('ours', 'ours_inituniform'),
    each under its BULLET_RAY_DUMMY_INIT and recorded with its run; an unknown one names the flag."""
    import json
    import os

    import pytest

    out = tmp_path / "o.json"
    offline = _fake_run(monkeypatch, lambda *_a: {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0})
    seen = []
    monkeypatch.setattr(offline, "run_ours", lambda args: seen.append(os.environ["BULLET_RAY_DUMMY_INIT"])
                        or {"requests_per_s": 20.0, "output_tokens_per_s": 4000.0,
                            "engine_switches": offline.engine_switches()})
    monkeypatch.delenv("BULLET_RAY_DUMMY_INIT", raising=False)
    assert offline.main(["--vllm", "--dummy-init", "normal,uniform", "--out", str(out)]) == 0
    assert seen == ["normal", "uniform"] and "BULLET_RAY_DUMMY_INIT" not in os.environ
    saved = json.loads(out.read_text())
    assert saved["ours_inituniform"]["engine_switches"]["BULLET_RAY_DUMMY_INIT"] == "uniform"
    assert saved["ours_inituniform_over_vllm"]["requests_per_s"] == 1.0
    with pytest.raises(SystemExit) as exc:
        offline.parse_args(["--dummy-init", "zeros"])
    assert exc.value.code == 2 and "--dummy-init" in capsys.readouterr().err


def test_plan_lead_flag_reaches_the_engine_config_or_names_itself():
    """--prefill-plan-lead-ms: the engine's default 10, a number, or none; anything else is one line naming it."""
    import pytest

    from benchmarks import offline

    assert offline.engine_config(offline.parse_args(["--device", "cpu"])).prefill_plan_lead_ms == 10.0
    assert offline.engine_config(offline.parse_args(["--device", "cpu", "--prefill-plan-lead-ms", "none"])) \
        .prefill_plan_lead_ms is None
    assert offline.parse_args(["--prefill-plan-lead-ms", "2.5"]).prefill_plan_lead_ms == 2.5
    for bad in ("-1", "soon"):
        with pytest.raises(SystemExit) as exc:
            offline.parse_args(["--prefill-plan-lead-ms", bad])
        assert exc.value.code == 2
