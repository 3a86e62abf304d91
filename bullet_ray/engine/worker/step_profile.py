"""A window of worker steps under the profilers: where a step's host and device time go.

With `profile_dir` set, a worker profiles its steps number `profile_start_step` to
`profile_start_step + profile_num_steps - 1` (counted from its first step) and writes into that folder:

- `<role>-host.txt`: cProfile of the worker's loop over the window, by cumulative and by own time (the
  host's share of a step, Python function by function);
- `<role>-ops.txt`: torch.profiler's operator tables, by device time (GPU) and by host time (blocking calls);
- `<role>-trace.json.gz`: the torch.profiler timeline (chrome://tracing, Perfetto);
- `<role>-summary.json`: wall time of the window, device-busy time (the union of kernel intervals), kernels
  and host launches per step.

Steps are counted at their launch (`tick`, called by the worker as it launches one), so step n is this worker's
n-th row of the step log (rows are written in launch order; the two sides of the bullet schedule write theirs
into one file, told apart by `side`). The window closes at the launch after its last step, or as soon as that
step is collected with nothing in flight (`after_collect`: a worker that goes idle is not profiled polling). Inside the window each step's launch opens a `bullet_step_<n>`
range of the timeline that lasts until the next launch, so a kernel's launch (its correlation id) names the
step it belongs to (`benchmarks/gpu/kernel_compare.py` sums device time per step that way).

Nothing is profiled unless `profile_dir` is set; the window's steps run slower than the others (the
profilers' own overhead), so the step log's times of those steps are not representative.
"""

from __future__ import annotations

import cProfile
import gzip
import io
import json
import logging
import os
import pstats
import shutil
import time
from typing import Any

logger = logging.getLogger(__name__)


class StepProfiler:
    """Counts steps; profiles the configured window; `tick` is called as each step is launched."""

    def __init__(self, folder: str | None, start_step: int, num_steps: int, role: str, is_gpu: bool) -> None:
        self.folder = folder
        self.start_step = start_step
        self.num_steps = num_steps
        self.role = role
        self.is_gpu = is_gpu
        self.num_steps_seen = 0
        self._torch_prof: Any = None
        self._step_range: Any = None  # the open `bullet_step_<n>` range while the window runs
        self._host_prof: cProfile.Profile | None = None
        self._started_s = 0.0

    @property
    def enabled(self) -> bool:
        return self.folder is not None and self.num_steps > 0

    def tick(self) -> None:
        """As a step is launched: open the window at its first step, close it after its last."""
        if not self.enabled:
            return
        if self.num_steps_seen == self.start_step:
            self._open()
        elif self.num_steps_seen == self.start_step + self.num_steps and self._torch_prof is not None:
            self._close()  # (unless `after_collect` closed it already)
        if self._torch_prof is not None:
            self._name_step(self.num_steps_seen)
        self.num_steps_seen += 1

    def after_collect(self, nothing_in_flight: bool) -> None:
        """A step was collected: once every step of the window was launched and none is in flight, close it."""
        if self._torch_prof is not None and nothing_in_flight \
                and self.num_steps_seen >= self.start_step + self.num_steps:
            self._close()

    def close(self) -> None:
        """The worker stops: a window still open is written as far as it got."""
        if self._torch_prof is not None:
            self._close()

    def _name_step(self, number: int | None) -> None:
        """End the previous step's timeline range; open step `number`'s (None: only end)."""
        from torch.profiler import record_function

        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if number is not None:
            self._step_range = record_function(f"bullet_step_{number}")
            self._step_range.__enter__()

    def _open(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.is_gpu else [])
        self._torch_prof = profile(activities=activities, record_shapes=False)
        self._torch_prof.__enter__()
        self._host_prof = cProfile.Profile()
        self._started_s = time.perf_counter()
        self._host_prof.enable()

    def _close(self) -> None:
        import torch

        assert self._host_prof is not None and self._torch_prof is not None and self.folder is not None
        self._name_step(None)
        self._host_prof.disable()
        if self.is_gpu:
            torch.cuda.synchronize()
        wall_s = time.perf_counter() - self._started_s
        prof, self._torch_prof = self._torch_prof, None
        prof.__exit__(None, None, None)
        os.makedirs(self.folder, exist_ok=True)
        base = os.path.join(self.folder, self.role)
        with open(f"{base}-host.txt", "w") as f:
            for order in ("cumulative", "tottime"):
                text = io.StringIO()
                pstats.Stats(self._host_prof, stream=text).sort_stats(order).print_stats(45)
                f.write(f"# sorted by {order}\n{text.getvalue()}\n")
        table = prof.key_averages()
        with open(f"{base}-ops.txt", "w") as f:  # by device time (kernels), then by host time (blocking calls)
            for sort_by in (["self_cuda_time_total"] if self.is_gpu else []) + ["self_cpu_time_total"]:
                f.write(f"# sorted by {sort_by}\n{table.table(sort_by=sort_by, row_limit=45)}\n\n")
        trace = f"{base}-trace.json"
        prof.export_chrome_trace(trace)
        with open(trace, "rb") as src, gzip.open(trace + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(trace)
        summary = {"role": self.role, "steps": [self.start_step, self.start_step + self.num_steps - 1],
                   "wall_ms": round(wall_s * 1e3, 3), **kernel_summary(prof.events(), self.num_steps)}
        with open(f"{base}-summary.json", "w") as f:
            json.dump(summary, f, indent=1)
        logger.warning("%s worker: profiled steps %s into %s: %s", self.role, summary["steps"], self.folder, summary)
        self._host_prof = None


def kernel_summary(events: Any, num_steps: int) -> dict[str, Any]:
    """Device-busy time (the union of the kernels' and copies' intervals), kernel and launch counts."""
    intervals: list[tuple[float, float]] = []
    num_kernels = num_launches = num_graph_launches = 0
    for ev in events:
        name = ev.name
        device_type = str(getattr(ev, "device_type", ""))
        if device_type.endswith("CUDA"):
            start = ev.time_range.start
            intervals.append((start, ev.time_range.end))
            if not name.startswith("Memcpy") and not name.startswith("Memset"):
                num_kernels += 1
        elif name in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"):
            num_launches += 1
        elif name == "cudaGraphLaunch":
            num_graph_launches += 1
    busy_us = 0.0
    end_us = None
    for start, end in sorted(intervals):
        if end_us is None or start > end_us:
            busy_us += end - start
            end_us = end
        elif end > end_us:
            busy_us += end - end_us
            end_us = end
    span_us = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    n = max(1, num_steps)
    return {"device_busy_ms": round(busy_us / 1e3, 3), "device_span_ms": round(span_us / 1e3, 3),
            "device_busy_fraction": round(busy_us / span_us, 4) if span_us else None,
            "kernels_per_step": round(num_kernels / n, 1), "kernel_launches_per_step": round(num_launches / n, 1),
            "graph_launches_per_step": round(num_graph_launches / n, 2)}
