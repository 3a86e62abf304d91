"""The real engine on one GPU under MPS: two worker processes sharing one copy of the weights and one KV
pool through CUDA IPC, each on its own SM partition.

1. Memory: GPU memory the engine takes (driver free-memory delta) vs one copy of the weights + the pool.
2. Same tokens: token-id prompts through the two-process schedule (prefill in one process, decode in the
   other) equal the one-process chunked schedule's.
3. Decode step time (from the shared state block) with decode on its partition alone, with prefill
   running beside it on the complementary partition, and decode alone on the whole GPU (chunked engine).

    python -m benchmarks.gpu.engine_two_process
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks.gpu.common import save
from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.state_block import Side

MODEL = "dummy:llama-3.1-8b"
KV_GB = 16.0


def decode_step_times(engine: LLMEngine, seconds: float, side: Side = Side.DECODE) -> list[float]:
    """Sample the decode row of the state block: one step time (ms) per new step."""
    times, last = [], engine.state.read(side)["step"]
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        row = engine.state.read(side)
        if row["step"] != last:
            times.append(row["step_time_us"] / 1e3)
            last = row["step"]
        time.sleep(0.0005)
    return times


def decode_load(engine: LLMEngine, n: int, prompt_len: int) -> list:
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    streams = [engine.stream([(i * 31 + j) % 30000 + 100 for j in range(prompt_len)], params) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:  # submit all at once; each returns at its first token
        list(pool.map(next, streams))
    return streams


def main() -> int:
    from bullet_ray.gpu.mps import MpsDaemon

    mps = MpsDaemon(f"bench-{os.getpid()}")
    mps.start()
    os.environ.update(mps.env())
    result: dict = {}
    try:
        torch.zeros(1, device="cuda")
        free0 = torch.cuda.mem_get_info()[0]
        prompts = [[(i * 13 + j) % 30000 + 100 for j in range(n)] for i, n in enumerate((17, 300, 1200, 64))]
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        cfg = EngineConfig(model=MODEL, device="cuda", schedule="static", kv_cache_memory_gb=KV_GB,
                           static_decode_sms=64, max_num_seqs=64)
        with LLMEngine(cfg) as engine:
            used = (free0 - torch.cuda.mem_get_info()[0]) / 2**30
            weights = engine.handles.weights.num_bytes / 2**30
            result["memory"] = {"engine_gpu_gib": round(used, 2), "weights_gib": round(weights, 2), "kv_pool_gib": KV_GB,
                                "one_copy_plus_pool_gib": round(weights + KV_GB, 2),
                                "workers": engine.worker_info}
            two = [o.token_ids for o in engine.generate(prompts, params)]
            # decode alone on its partition, then with prefill running beside it
            streams = decode_load(engine, 32, 512)
            alone = decode_step_times(engine, 3.0)
            long_prompts = [[(i * 7 + j) % 30000 + 100 for j in range(2048)] for i in range(48)]
            prefill_steps0 = engine.state.read(Side.PREFILL)["step"]
            burst = threading.Thread(target=engine.generate,
                                     args=(long_prompts, SamplingParams(temperature=0.0, max_tokens=1)))
            burst.start()
            time.sleep(0.2)
            beside = decode_step_times(engine, 3.0)
            prefill_steps = engine.state.read(Side.PREFILL)["step"] - prefill_steps0
            burst.join()
            # move the split while decode runs: the shrinking side first, both acknowledge
            before = engine.split_indexes()
            target = before["requested"] + 2
            t0 = time.monotonic()
            engine.request_split(target)
            while engine.split_indexes() != {"requested": target, "prefill": target, "decode": target}:
                if time.monotonic() - t0 > 10:
                    break
                time.sleep(0.0002)
            result["split_switch"] = {"from": before, "to": engine.split_indexes(),
                                      "acked_after_ms": round((time.monotonic() - t0) * 1e3, 2)}
            after = decode_step_times(engine, 1.5)
            result["split_switch"]["decode_step_ms_after"] = round(statistics.median(after), 2) if after else None
            for s in streams:
                s.close()
            split = engine.worker_info
        with LLMEngine(cfg.replace(partition="none")) as engine:  # both workers on the whole GPU (no split)
            streams = decode_load(engine, 32, 512)
            whole_graphs = decode_step_times(engine, 3.0)
            burst = threading.Thread(target=engine.generate,
                                     args=(long_prompts, SamplingParams(temperature=0.0, max_tokens=1)))
            burst.start()
            time.sleep(0.2)
            whole_beside = decode_step_times(engine, 3.0)
            burst.join()
            for s in streams:
                s.close()
        with LLMEngine(cfg.replace(schedule="chunked")) as engine:
            one = [o.token_ids for o in engine.generate(prompts, params)]
            streams = decode_load(engine, 32, 512)
            whole = decode_step_times(engine, 3.0)
            for s in streams:
                s.close()
        result["same_tokens"] = {"equal": two == one,
                                 "agreement": [sum(a == b for a, b in zip(x, y)) / len(x) for x, y in zip(two, one)]}
        med = statistics.median
        result["decode_step_ms"] = {
            "batch": 32, "context": "512 + growing",
            "partition_alone": round(med(alone), 2) if alone else None,
            "partition_with_prefill_beside": round(med(beside), 2) if beside else None,
            "whole_gpu_alone_chunked_engine_eager": round(med(whole), 2) if whole else None,
            "whole_gpu_alone_graphs": round(med(whole_graphs), 2) if whole_graphs else None,
            "whole_gpu_with_prefill_unpartitioned": round(med(whole_beside), 2) if whole_beside else None,
            "prefill_steps_during_window": prefill_steps, "decode_sms": 64, "workers": split}
        print(result)
        save("gpu_engine_two_process_h100", result)
    finally:
        mps.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
