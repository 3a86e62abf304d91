"""The real engine on one GPU under MPS (schedule "bullet"): a prefill and a decode worker process sharing
one copy of the weights and one KV pool through CUDA IPC.

1. Memory: each process's GPU memory (NVML per process, and nvidia-smi's view) and the driver's
   free-memory delta of the whole engine, next to one copy of the weights + the pool.
2. Same tokens: token-id prompts prefilled in the prefill process and decoded in the decode process give
   the same greedy tokens as the one-process chunked schedule (schedule="chunked"). Both runs get a token
   budget that holds every prompt, so each prefills them in one step and then runs pure decode steps of
   the same batch: the same kernels on the same batches. With a smaller budget the chunked schedule
   decodes some tokens inside mixed prefill+decode steps (the prefill kernel), whose bf16 rounding differs
   from the decode kernel's, and random dummy weights have near-tied logits, so tokens flip; that run is
   kept too (`same_tokens_default_budget`).
3. Decode step time (from the shared state block) of 32 sequences on the decode partition, for reference.

    python -m benchmarks.gpu.engine_two_process
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.gpu.common import save
from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.state_block import Side

MODEL = "dummy:llama-3.1-8b"
KV_GB = 16.0
PROMPT_LENGTHS = (17, 300, 1200, 64, 5, 700)
NUM_NEW = 48


def per_process_memory() -> dict[str, Any]:
    """GPU memory per process: NVML's compute-process list and nvidia-smi's, as they report it."""
    out: dict[str, Any] = {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        out["nvml"] = {str(p.pid): round((p.usedGpuMemory or 0) / 2**30, 2) for p in procs}
        info = pynvml.nvmlDeviceGetMemoryInfo(h)
        out["nvml_device_used_gib"] = round(info.used / 2**30, 2)
    except Exception as exc:  # noqa: BLE001 - report what could be read
        out["nvml_error"] = repr(exc)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        out["nvidia_smi"] = smi.stdout.strip().splitlines()
    except Exception as exc:  # noqa: BLE001
        out["nvidia_smi_error"] = repr(exc)
    return out


def decode_step_times(engine: LLMEngine, seconds: float) -> list[float]:
    times, last = [], engine.state.read(Side.DECODE)["step"]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        row = engine.state.read(Side.DECODE)
        if row["step"] != last:
            times.append(row["step_time_us"] / 1e3)
            last = row["step"]
        time.sleep(0.0005)
    return times


def _agreement(two: list[list[int]], one: list[list[int]], budget: int) -> dict[str, Any]:
    return {"equal": two == one, "max_num_batched_tokens": budget, "prompt_lengths": list(PROMPT_LENGTHS),
            "num_new_tokens": NUM_NEW,
            "agreement": [sum(a == b for a, b in zip(x, y)) / max(1, len(x)) for x, y in zip(two, one)],
            "first_divergence": [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                                 for x, y in zip(two, one)]}


def main() -> int:
    from bullet_ray.gpu.mps import MpsDaemon

    mps = MpsDaemon(f"bench-{os.getpid()}")
    mps.start()
    os.environ.update(mps.env())
    result: dict[str, Any] = {"model": MODEL, "kv_pool_gib": KV_GB}
    try:
        torch.zeros(1, device="cuda")
        free0 = torch.cuda.mem_get_info()[0]
        prompts = [[(i * 13 + j) % 30000 + 100 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
        params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
        cfg = EngineConfig(model=MODEL, device="cuda", schedule="bullet", kv_cache_memory_gb=KV_GB, max_num_seqs=64)
        t0 = time.monotonic()
        with LLMEngine(cfg) as engine:
            result["engine_start_s"] = round(time.monotonic() - t0, 1)
            two = [o.token_ids for o in engine.generate(prompts, params)]
            used = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
            weights = engine.handles.weights.num_bytes / 2**30
            result["memory"] = {"engine_gpu_gib_driver_delta": round(used, 2), "weights_gib": round(weights, 2),
                                "kv_pool_gib": KV_GB, "one_copy_plus_pool_gib": round(weights + KV_GB, 2),
                                "per_process": per_process_memory(), "workers": engine.worker_info}
            print("memory", result["memory"], f"t={time.monotonic() - t0:.0f}s", flush=True)
            load = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
            streams = [engine.stream([(i * 31 + j) % 30000 + 100 for j in range(512)], load) for i in range(32)]
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(next, streams))
            print(f"32 streams started t={time.monotonic() - t0:.0f}s", flush=True)
            steps = decode_step_times(engine, 3.0)
            result["decode_step_ms_bs32_ctx512"] = round(statistics.median(steps), 2) if steps else None
            for s in streams:
                s.close()
            print(f"decode step {result['decode_step_ms_bs32_ctx512']} ms, streams closed t={time.monotonic() - t0:.0f}s",
                  flush=True)
        with LLMEngine(cfg.replace(schedule="chunked")) as engine:
            one = [o.token_ids for o in engine.generate(prompts, params)]
        print(f"chunked run done t={time.monotonic() - t0:.0f}s", flush=True)
        result["same_tokens_default_budget"] = _agreement(two, one, cfg.max_num_batched_tokens)
        print("same tokens, default budget", result["same_tokens_default_budget"], flush=True)
        whole = cfg.replace(max_num_batched_tokens=4096)  # every prompt in one step
        with LLMEngine(whole) as engine:
            two = [o.token_ids for o in engine.generate(prompts, params)]
        with LLMEngine(whole.replace(schedule="chunked")) as engine:
            one = [o.token_ids for o in engine.generate(prompts, params)]
        result["same_tokens"] = _agreement(two, one, whole.max_num_batched_tokens)
        print("same tokens", result["same_tokens"], flush=True)
    finally:
        save("gpu_engine_two_process_h100", result)
        mps.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
