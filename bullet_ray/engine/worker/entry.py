"""The worker process's entry point: `run_worker(spec)`, which every launcher calls (a plain process or a Ray
actor): connect to the engine front, set up (create or attach the shared weights, KV pool and state
block), build the role's worker, send the handles (the creating worker: the front starts the other worker then),
capture the worker's CUDA graphs, send Ready and serve until Shutdown or the front goes away."""

from __future__ import annotations

import logging
import os
import time
import traceback
from multiprocessing.connection import Client

import torch

from bullet_ray.engine.gc_pauses import freeze_heap
from bullet_ray.engine.messages import Handles, Ready, WorkerFailed, WorkerSpec
from bullet_ray.engine.worker.main import WorkerBase, available_cores, cpu_threads
from bullet_ray.engine.worker.roles import DecodeWorker, HybridWorker, PrefillWorker
from bullet_ray.engine.worker.setup import WorkerResources, attach_resources, create_resources

logger = logging.getLogger(__name__)


def _device(spec: WorkerSpec) -> torch.device:
    if not spec.config.is_gpu:
        torch.set_num_threads(cpu_threads(spec.role, available_cores()))
        return torch.device("cpu")
    device = torch.device(spec.config.device if ":" in spec.config.device else "cuda:0")
    torch.cuda.set_device(device)
    return device


def _worker_class(role: str) -> type[WorkerBase]:
    return {"prefill": PrefillWorker, "decode": DecodeWorker, "hybrid": HybridWorker}[role]


def _device_info(device: torch.device) -> dict:
    info: dict = {"pid": os.getpid(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu_uuid=str(props.uuid), gpu_name=props.name, num_sms=props.multi_processor_count)
    return info


def log_startup(spec: WorkerSpec, startup_s: dict[str, float], graphs: dict,
                handles_after_s: float | None = None, perf_model: str | None = None,
                gc_frozen: int | None = None) -> None:
    """One `startup` record in the step log (where there is one): the seconds each part of this worker's start-up
    took (`resources`: load or attach the weights, KV pool and state block; the worker's own parts, e.g.
    `decode_graphs`, `piecewise_graphs`; `total`), how many graphs it captured, and for the worker that creates
    the shared memory `handles_after_s`: seconds from its start to its Handles (when the other worker could start);
    a bullet side's `perf_model`: the profile its predictions start from (bullet_ray.perf.loading); `gc_frozen`: the
    objects its heap freeze moved out of the collector's reach (engine.gc_freeze; None: no freeze)."""
    if not spec.config.step_log_path:
        return
    from bullet_ray.engine.worker.policy_link import StepLog

    log = StepLog(spec.config.step_log_path)
    counts = {"decode_graphs": graphs.get("num_graphs"), "piecewise_graphs": (graphs.get("piecewise") or {}).get(
        "num_graphs")}
    extra = {**counts, "handles_after_s": handles_after_s, "prefill_gemm": graphs.get("prefill_gemm"),
             "perf_model": perf_model, "gc_frozen": gc_frozen}
    log.write("startup", role=spec.role, seconds=startup_s, **{k: v for k, v in extra.items() if v is not None})
    log.close()


def run_worker(spec: WorkerSpec) -> None:
    """Connect to the engine front, set up (create or attach), serve until Shutdown or the front goes away."""
    logging.basicConfig(level=os.environ.get("BULLET_RAY_LOG_LEVEL", "WARNING"))
    conn = Client(spec.address, family="AF_UNIX", authkey=spec.authkey)
    resources: WorkerResources | None = None
    try:
        started = time.perf_counter()
        device = _device(spec)
        if spec.attach is None:
            resources = create_resources(spec.config, os.path.dirname(spec.address), device)
        else:
            resources = attach_resources(spec.config, spec.attach, device)
        made = time.perf_counter()
        # partitions; the creator resets the split switch and tunes its piecewise buckets (alone on the GPU)
        worker = _worker_class(spec.role)(spec, conn, resources)
        try:
            handles_after_s = None
            if spec.attach is None:  # the front starts the other worker now; it captures its graphs beside ours
                conn.send(Handles(spec.role, resources.handles, os.getpid()))
                handles_after_s = round(time.perf_counter() - started, 3)
            worker.capture_graphs()
            frozen = None
            if spec.config.gc_freeze:  # after every graph and buffer of the start-up, before the first step
                froze_at = time.perf_counter()
                frozen = freeze_heap()
                worker.startup_s["gc_freeze"] = round(time.perf_counter() - froze_at, 3)
            startup_s = {"resources": round(made - started, 3), **worker.startup_s,
                         "total": round(time.perf_counter() - started, 3)}
            log_startup(spec, startup_s, worker.graph_capture, handles_after_s, getattr(worker, "perf_source", None),
                        gc_frozen=frozen)
            info = {**_device_info(device), "graphs": worker.graph_capture or None, "startup_s": startup_s,
                    "handles_after_s": handles_after_s,  # seconds from this worker's start to its Handles
                    "ladder_size": len(worker.partitioner.ladder),  # the entries a split request may name
                    "ladder_decode_sms": [e.decode_sms for e in worker.partitioner.ladder],  # as granted
                    "handoff_address": getattr(worker, "handoff_address", None),  # handoff: direct (decode worker)
                    "mixed_attention": getattr(resources.backend, "mixed_attention", None)}  # flashinfer's mode
            conn.send(Ready(spec.role, info))
            worker.run()
        finally:
            worker.close()
    except (EOFError, ConnectionError, BrokenPipeError):
        logger.warning("%s worker: engine front went away; exiting", spec.role)
    except BaseException:
        error = traceback.format_exc()
        logger.error("%s worker failed:\n%s", spec.role, error)
        try:
            conn.send(WorkerFailed(spec.role, error))
        except (OSError, EOFError):
            pass
    finally:
        if resources is not None:
            resources.close()
        conn.close()
