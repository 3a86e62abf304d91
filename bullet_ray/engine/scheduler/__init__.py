"""Per-worker schedulers: which sequences run in the next step and with how many tokens. Pure Python.

prefill.py: the prefill worker's queue (bullet, static).  decode.py: the decode worker's running set.
chunked.py: one hybrid batch per step (the chunked-prefill baseline).  All take a block allocator that
returns None when full and never raise for it.
"""

from __future__ import annotations

from bullet_ray.engine.scheduler.base import BlockSource, ScheduledSeq

__all__ = ["BlockSource", "ScheduledSeq"]
