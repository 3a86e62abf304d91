"""Runtime folders (shared weights, KV pool): pid files, the sweep of dead fronts' folders, the watchdog."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bullet_ray.engine.runtime_dir import (
    OWNER_FILE,
    ProcessRef,
    create_runtime_dir,
    read_pid_file,
    start_watchdog,
    sweep_orphans,
    watch,
    worker_refs,
    write_pid_file,
)

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def _wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_runtime_folders_of_dead_engine_fronts_are_swept(tmp_path):
    for name, pid in (("bullet_ray-dead", _dead_pid()), ("bullet_ray-alive", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER_FILE).write_text(str(pid))  # the older format: the pid alone
        (tmp_path / name / "kv_pool").write_bytes(b"x" * 1024)
    (tmp_path / "bullet_ray-unowned").mkdir()  # no owner file: left alone
    (tmp_path / "other").mkdir()
    assert sweep_orphans(str(tmp_path)) == [str(tmp_path / "bullet_ray-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bullet_ray-alive", "bullet_ray-unowned", "other"]


def test_pid_files_carry_the_start_time_so_a_recycled_pid_is_not_the_same_process(tmp_path):
    write_pid_file(str(tmp_path), "x.pid", os.getpid())
    ref = read_pid_file(str(tmp_path / "x.pid"))
    assert ref is not None and ref.pid == os.getpid() and ref.is_running()
    if ref.start_ticks is not None:  # Linux
        assert not ProcessRef(os.getpid(), ref.start_ticks + 1).is_running()
    assert not ProcessRef(_dead_pid()).is_running()
    (tmp_path / "bad.pid").write_text("not a pid")
    assert read_pid_file(str(tmp_path / "bad.pid")) is None


def test_create_runtime_dir_writes_the_owner_and_sweeps_first(tmp_path):
    (tmp_path / "bullet_ray-old").mkdir()
    (tmp_path / "bullet_ray-old" / OWNER_FILE).write_text(str(_dead_pid()))
    path = create_runtime_dir(str(tmp_path))
    assert os.path.basename(path).startswith("bullet_ray-")
    owner = read_pid_file(os.path.join(path, OWNER_FILE))
    assert owner is not None and owner.pid == os.getpid()
    assert sorted(p.name for p in tmp_path.iterdir()) == [os.path.basename(path)]


def test_watch_returns_when_the_front_removed_the_folder(tmp_path):
    folder = tmp_path / "bullet_ray-x"
    folder.mkdir()
    write_pid_file(str(folder), OWNER_FILE, os.getpid())
    folder_s = str(folder)
    import threading

    threading.Timer(0.2, lambda: __import__("shutil").rmtree(folder_s)).start()
    assert watch(folder_s, poll_s=0.02) == "removed"


def test_watch_kills_workers_that_outlive_their_front_and_removes_the_folder(tmp_path):
    front = subprocess.Popen(SLEEPER)
    worker = subprocess.Popen(SLEEPER)
    folder = tmp_path / "bullet_ray-y"
    folder.mkdir()
    write_pid_file(str(folder), OWNER_FILE, front.pid)
    write_pid_file(str(folder), "worker-decode.pid", worker.pid)
    (folder / "kv_pool").write_bytes(b"x" * 4096)
    assert set(worker_refs(str(folder))) == {"decode"}
    front.kill()
    front.wait()
    assert watch(str(folder), poll_s=0.02, grace_s=0.2) == "released"
    assert worker.wait(10) == -9
    assert not folder.exists()


def test_the_watchdog_process_survives_the_front_and_cleans_up(tmp_path):
    """The real watchdog process: the front (a child here) is SIGKILLed, the watchdog removes the folder."""
    code = ("import sys, time; from bullet_ray.engine.runtime_dir import create_runtime_dir, start_watchdog; "
            f"p = create_runtime_dir({str(tmp_path)!r}); start_watchdog(p); print(p, flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert front.stdout is not None
    folder = front.stdout.readline().strip()
    assert os.path.isdir(folder)
    time.sleep(0.5)  # the watchdog has read the owner file
    front.kill()
    front.wait()
    assert _wait_for(lambda: not os.path.exists(folder)), os.listdir(folder)


def test_start_watchdog_detaches_and_exits_once_the_folder_is_gone(tmp_path):
    folder = create_runtime_dir(str(tmp_path))
    watchdog = ProcessRef.of(start_watchdog(folder))
    assert watchdog.is_running()
    with open(f"/proc/{watchdog.pid}/stat") as f:
        assert int(f.read().rsplit(")", 1)[1].split()[1]) != os.getpid()  # not our child: Ray cannot reap it
    __import__("shutil").rmtree(folder)
    assert _wait_for(lambda: not watchdog.is_running())
