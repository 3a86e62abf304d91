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
