"""When the engine starts its second worker: as soon as the first one's shared memory exists, or once it is ready.

The first worker (prefill, `WorkerSpec.attach` None) creates the weights, KV pool and state block, sends their
handles (`Handles`), then captures its CUDA graphs and sends `Ready`; the second (decode) maps that memory and
captures graphs of its own. Nothing the second does at start needs the first's graphs, so the front starts it at
the handles and the two captures overlap (on the H200, dummy Llama-3.1-8B, split_policy slo: prefill 10.8 s to
its handles + 39.4 s of piecewise graphs, decode 10.5 s + 52.8 s of decode graphs; one after the other 114 s of
worker time, overlapped about 10.8 + 63.4 = 74 s if neither slows the other, not measured yet).

Piecewise bucket tuning, which times GEMMs to choose buckets, still runs alone. The first worker tunes its
buckets before it sends its handles (`WorkerBase.__init__`). When the second worker tunes its own
(`tunes_piecewise_buckets`: the decode side with the mixed fallback), the front starts it only at the first one's
Ready (`overlaps_startup`).

One timed choice does NOT run alone. The decode side's choice, per batch bucket, between a plain graph and one
whose GEMMs aim at its SMs (bullet_ray.engine.cuda_graphs, `_capture_tuned`; on by default on a partition smaller
than the GPU) times its replays while the prefill worker captures beside it. So the choice may differ from a
sequential start's. The decode worker's Ready info says whether it did (`graphs.sm_target.timed_beside_prefill`).
`BULLET_RAY_STARTUP_OVERLAP=0` keeps the sequential order in every configuration, for an A/B.

Functions of the config and of that variable: the front and the workers both read them (no torch here).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bullet_ray.config import EngineConfig

_ON, _OFF = ("1", "on"), ("0", "off")


def uses_cuda_graphs(config: EngineConfig) -> bool:
    """Whether a worker captures CUDA graphs at start: on GPU with flashinfer, unless `enforce_eager`."""
    return config.is_gpu and not config.enforce_eager and config.attention_backend_name == "flashinfer"


def tunes_piecewise_buckets(config: EngineConfig, role: str, num_partitions: int) -> bool:
    """Whether a worker of `role` that captures its piecewise graphs on `num_partitions` partitions chooses their
    token buckets from GEMMs it times at start (`PiecewiseGraphs.tune`): with `piecewise_buckets: tuned`, only on
    one partition (where slow row counts fall depends on the SMs a side has): the hybrid worker, a prefill side
    whose split stays fixed, a decode side with the mixed fallback (it captures them on its whole-GPU entry
    alone)."""
    return (uses_cuda_graphs(config) and config.piecewise_limit(role) > 0 and config.piecewise_buckets == "tuned"
            and num_partitions == 1)


def overlap_enabled() -> bool:
    """BULLET_RAY_STARTUP_OVERLAP: "1" / "on" (default), "0" / "off" (the second worker starts at the first's
    Ready, as before the overlap: an A/B of start-up time and of what the workers time at start)."""
    value = os.environ.get("BULLET_RAY_STARTUP_OVERLAP", "1")
    if value not in _ON + _OFF:
        raise ValueError(f"BULLET_RAY_STARTUP_OVERLAP must be one of {', '.join(_ON + _OFF)}, got {value!r}")
    return value in _ON


def overlaps_startup(config: EngineConfig) -> bool:
    """Whether the front starts the decode worker at the prefill worker's handles (True) or at its Ready: not
    when decode tunes piecewise buckets (the prefill worker's captures would run beside its timing), nor with
    BULLET_RAY_STARTUP_OVERLAP=0."""
    return overlap_enabled() and not tunes_piecewise_buckets(config, "decode", 1)
