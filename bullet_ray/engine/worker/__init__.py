"""Worker processes: the prefill and decode workers of the bullet schedule and the hybrid (chunked) one.

`run_worker(spec)` is the entry point every launcher calls (plain process or Ray actor).
"""

from __future__ import annotations

from bullet_ray.engine.worker.entry import run_worker

__all__ = ["run_worker"]
