"""MPS daemon management against a fake nvidia-cuda-mps-control (a shell script made here): per-deployment
pipe folders, the commands sent, status parsing, require_mps, the CLI and deploy/mps scripts; NVML wrapper
without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bullet_ray.errors import ConfigError
from bullet_ray.gpu import nvml
from bullet_ray.gpu.mps import MpsDaemon, MpsError, MpsNotRunningError, main, parse_server_list, require_mps

ROOT = Path(__file__).resolve().parents[2]


def _fake_control(tmp_path: Path) -> Path:
    """-d creates the control pipe; stdin 'quit' removes it; 'get_server_list' answers two PIDs. Every call
    is logged with its pipe folder (to check what was sent, and where)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "nvidia-cuda-mps-control"
    log = tmp_path / "calls.log"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "-d" ]; then
  echo "-d $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {log}
  touch "$CUDA_MPS_PIPE_DIRECTORY/control"; exit 0
fi
[ -e "$CUDA_MPS_PIPE_DIRECTORY/control" ] || {{ echo "Cannot find MPS control daemon process" >&2; exit 1; }}
read cmd
echo "$cmd $CUDA_MPS_PIPE_DIRECTORY" >> {log}
case "$cmd" in
  quit) rm -f "$CUDA_MPS_PIPE_DIRECTORY/control";;
  get_server_list) echo 4242; echo 4343;;
esac
""")
    script.chmod(0o755)
    return script


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_daemon_lifecycle_and_commands(tmp_path):
    control = str(_fake_control(tmp_path))
    root = str(tmp_path / "mps")
    a = MpsDaemon("engine-a", root=root, control=control)
    b = MpsDaemon("engine-b", root=root, control=control)
    assert a.pipe_dir == f"{root}/engine-a/pipe" and a.log_dir == f"{root}/engine-a/log"
    assert a.pipe_dir != b.pipe_dir  # two deployments on one host never share a daemon
    assert a.env() == {"CUDA_MPS_PIPE_DIRECTORY": a.pipe_dir, "CUDA_MPS_LOG_DIRECTORY": a.log_dir}
    assert a.command("-d") == [control, "-d"]
    assert not a.status().is_running and a.status().detail == "no control pipe"
    status = a.start()
    assert status.is_running and status.server_pids == (4242, 4343)
    assert os.path.isdir(a.log_dir)
    assert a.start().is_running  # idempotent: no second -d
    assert not b.status().is_running
    assert a.stop() and not a.status().is_running
    assert a.stop()  # no-op when stopped
    calls = _calls(tmp_path)
    assert calls.count(f"-d {a.pipe_dir} {a.log_dir}") == 1
    assert f"quit {a.pipe_dir}" in calls and not any(b.pipe_dir in c for c in calls)


def test_require_mps_names_the_pipe_folder(tmp_path):
    a = MpsDaemon("engine-a", root=str(tmp_path / "mps"), control=str(_fake_control(tmp_path)))
    with pytest.raises(MpsNotRunningError, match=a.pipe_dir):
        require_mps(a.env())
    with pytest.raises(MpsNotRunningError, match="CUDA_MPS_PIPE_DIRECTORY is not set"):
        require_mps({})  # no silent fallback to NVIDIA's global /tmp/nvidia-mps
    a.start()
    assert require_mps(a.env()) == a.pipe_dir
    a.stop()


def test_status_when_pipe_is_stale(tmp_path):
    a = MpsDaemon("stale", root=str(tmp_path / "mps"), control=str(_fake_control(tmp_path)))
    os.makedirs(a.pipe_dir)
    Path(a.pipe_dir, "control").touch()
    Path(tmp_path, "bin", "nvidia-cuda-mps-control").write_text("#!/bin/sh\necho 'daemon died' >&2; exit 1\n")
    status = a.status()
    assert not status.is_running and "daemon died" in status.detail


def test_missing_control_binary_is_a_clear_error(tmp_path):
    a = MpsDaemon("x", root=str(tmp_path), control="no-such-mps-control")
    with pytest.raises(MpsError, match="no-such-mps-control not found"):
        a.start()
    assert not a.status().is_running


@pytest.mark.parametrize("name", ["../etc", "", "a b", "x" * 65, ".."])
def test_bad_names_are_rejected(name):
    with pytest.raises(ConfigError, match="mps_name"):
        MpsDaemon(name)


def test_parse_server_list():
    assert parse_server_list("123\n 456 \nnot a pid\n") == (123, 456)
    assert parse_server_list("") == ()


def test_cli_and_deploy_scripts(tmp_path, capsys, monkeypatch):
    _fake_control(tmp_path)
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
           "PYTHON": sys.executable, "BULLET_RAY_MPS_ROOT": str(tmp_path / "mps")}

    def script(action: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(ROOT / "deploy" / "mps" / f"{action}.sh"), "dep1"], env=env,
                              capture_output=True, text=True, timeout=60)

    assert script("status").returncode == 1
    started = script("start")
    assert started.returncode == 0 and f"{tmp_path}/mps/dep1/pipe" in started.stdout
    assert script("status").returncode == 0
    assert script("stop").returncode == 0
    assert script("status").returncode == 1
    monkeypatch.setenv("PATH", env["PATH"])
    assert main(["env", "dep2", "--root", str(tmp_path / "r")]) == 0
    assert f"export CUDA_MPS_PIPE_DIRECTORY={tmp_path}/r/dep2/pipe" in capsys.readouterr().out


def test_nvml_without_a_gpu_returns_nothing():
    if nvml.device_count() > 0:
        pytest.skip("this machine has a GPU")
    assert nvml.gpu_uuid() is None and nvml.memory() is None and nvml.sm_count() is None
    assert nvml.utilization() is None and nvml.process_memory() == []
    assert nvml.sm_clock_mhz() is None and nvml.power_watts() is None
    snap = nvml.snapshot()
    assert snap["uuid"] is None and snap["processes"] == []
