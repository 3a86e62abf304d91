"""Runtime folders (shared weights, KV pool) left by an engine front that was killed are removed later."""

from __future__ import annotations

import os
import subprocess
import sys

from bullet_ray.engine.llm_engine import OWNER_FILE, _sweep_orphans


def test_runtime_folders_of_dead_engine_fronts_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, pid in (("bullet_ray-dead", dead.pid), ("bullet_ray-alive", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / OWNER_FILE).write_text(str(pid))
        (tmp_path / name / "kv_pool").write_bytes(b"x" * 1024)
    (tmp_path / "bullet_ray-unowned").mkdir()  # no owner file: left alone
    (tmp_path / "other").mkdir()
    assert _sweep_orphans(str(tmp_path)) == [str(tmp_path / "bullet_ray-dead")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bullet_ray-alive", "bullet_ray-unowned", "other"]
