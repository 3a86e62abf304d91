"""The worker's step profiler: the window it profiles, what it writes, and the device-busy arithmetic."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import torch

from bullet_ray.config import EngineConfig
from bullet_ray.engine.worker.step_profile import StepProfiler, kernel_summary
from bullet_ray.errors import ConfigError


def test_profiles_exactly_the_configured_window(tmp_path):
    prof = StepProfiler(str(tmp_path), start_step=2, num_steps=3, role="hybrid", is_gpu=False)
    x = torch.randn(64, 64)
    for _ in range(8):
        prof.tick()  # as each step is launched
        x = torch.tanh(x @ x)
    prof.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["hybrid-host.txt", "hybrid-ops.txt", "hybrid-summary.json", "hybrid-trace.json.gz"]
    summary = json.loads((tmp_path / "hybrid-summary.json").read_text())
    assert summary["steps"] == [2, 4] and summary["wall_ms"] > 0
    assert "aten::mm" in (tmp_path / "hybrid-ops.txt").read_text()
    assert "tanh" in (tmp_path / "hybrid-host.txt").read_text() or "sorted by cumulative" in (tmp_path / "hybrid-host.txt").read_text()
    with gzip.open(tmp_path / "hybrid-trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    # each profiled step is a named range of the timeline, holding that step's ops (kernel_compare's per-step split)
    ranges = {e["name"]: e for e in events if str(e.get("name", "")).startswith("bullet_step_")}
    assert sorted(ranges) == ["bullet_step_2", "bullet_step_3", "bullet_step_4"]
    for r in ranges.values():
        inside = [e for e in events if e.get("name") == "aten::mm" and r["ts"] <= e["ts"] <= r["ts"] + r["dur"]]
        assert len(inside) == 1


def test_without_a_folder_nothing_is_profiled(tmp_path):
    prof = StepProfiler(None, 0, 5, "decode", is_gpu=False)
    for _ in range(3):
        prof.tick()
    prof.close()
    assert not prof.enabled and prof._torch_prof is None


def test_a_window_cut_short_by_shutdown_is_still_written(tmp_path):
    prof = StepProfiler(str(tmp_path), 0, 100, "prefill", is_gpu=False)
    prof.tick()
    prof.close()
    assert json.loads((tmp_path / "prefill-summary.json").read_text())["steps"] == [0, 99]


def _event(name: str, start: float, end: float, cuda: bool = True) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type="DeviceType.CUDA" if cuda else "DeviceType.CPU",
                           time_range=SimpleNamespace(start=start, end=end))


def test_device_busy_time_is_the_union_of_kernel_intervals():
    events = [_event("gemm", 0, 10), _event("norm", 5, 12), _event("Memcpy HtoD", 20, 22),
              _event("attn", 30, 40), _event("cudaLaunchKernel", 0, 1, cuda=False),
              _event("cudaGraphLaunch", 2, 3, cuda=False)]
    s = kernel_summary(events, num_steps=2)
    assert s["device_busy_ms"] == 0.024 and s["device_span_ms"] == 0.04  # 12 + 2 + 10 us of 40
    assert s["device_busy_fraction"] == 0.6
    assert s["kernels_per_step"] == 1.5 and s["kernel_launches_per_step"] == 0.5
    assert s["graph_launches_per_step"] == 0.5


def test_profile_window_bounds_are_checked():
    for field, value in (("profile_start_step", -1), ("profile_num_steps", 0)):
        try:
            EngineConfig(**{field: value})
        except ConfigError as e:
            assert field in str(e)
        else:
            raise AssertionError(f"{field}={value} accepted")


def test_asynchronous_scheduling_defaults_to_the_gpu():
    assert EngineConfig(device="cuda").is_async_scheduling
    assert not EngineConfig(device="cpu").is_async_scheduling
    assert not EngineConfig(device="cuda", async_scheduling=False).is_async_scheduling
    assert EngineConfig(device="cpu", async_scheduling=True).is_async_scheduling


def test_a_window_closes_once_its_last_step_is_collected_with_nothing_in_flight(tmp_path):
    """A worker that goes idle after the window's last step is not profiled polling until its next launch."""
    prof = StepProfiler(str(tmp_path), start_step=1, num_steps=2, role="hybrid", is_gpu=False)
    prof.tick()  # step 0
    prof.after_collect(nothing_in_flight=True)
    assert prof._torch_prof is None
    prof.tick()  # step 1: the window opens
    prof.after_collect(nothing_in_flight=True)  # step 1 collected, step 2 not launched yet: stays open
    assert prof._torch_prof is not None
    prof.tick()  # step 2, the window's last
    prof.after_collect(nothing_in_flight=False)  # something still in flight: stays open
    assert prof._torch_prof is not None
    prof.after_collect(nothing_in_flight=True)
    assert prof._torch_prof is None and (tmp_path / "hybrid-summary.json").is_file()
    prof.tick()  # the next launch finds the window closed already
    prof.close()
    assert json.loads((tmp_path / "hybrid-summary.json").read_text())["steps"] == [1, 2]


def test_the_worker_counts_launches():
    """WorkerBase.launch ticks the profiler once per launched step (a loop turn that plans nothing does not
    launch), so the profiled window's step numbers are the step log's rows."""
    from tests.unit.test_follow_split import _Launcher

    worker = _Launcher()
    for _ in range(3):
        worker.launch([])
    assert worker.profiler.num_steps_seen == 0  # a disabled profiler counts nothing
    worker.profiler = StepProfiler(None, 0, 0, "decode", is_gpu=False)
    worker.profiler.folder, worker.profiler.num_steps, worker.profiler.start_step = "unused", 1, 10**9
    for _ in range(3):
        worker.launch([])
    assert worker.profiler.num_steps_seen == 3
