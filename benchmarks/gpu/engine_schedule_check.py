"""Which engine configuration gives the one-process chunked schedule's tokens? Same token-id prompts through
the real LLMEngine (Llama-3.1-8B dummy weights, under MPS) in several variants, each compared with the
chunked schedule: bullet eager, bullet with decode CUDA graphs (whole GPU and on a partition), and with
the fused layer kernels or programmatic dependent launch turned off.

    python -m benchmarks.gpu.engine_schedule_check
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from benchmarks.gpu.common import save
from benchmarks.offline import environment
from bullet_ray.config import EngineConfig
from bullet_ray.engine.llm_engine import LLMEngine
from bullet_ray.engine.sampling_params import SamplingParams

MODEL = "dummy:llama-3.1-8b"
PROMPT_LENGTHS = (17, 300, 1200, 64, 5, 700)
NUM_NEW = 48

VARIANTS: list[tuple[str, dict[str, Any], dict[str, str]]] = [
    ("chunked", {"schedule": "chunked"}, {}),
    ("bullet_eager", {"enforce_eager": True}, {}),
    ("bullet_graphs_no_partition", {"partition": "none"}, {}),
    ("bullet_graphs", {}, {}),
    ("bullet_graphs_no_pdl", {}, {"BULLET_RAY_DISABLE_PDL": "1"}),
    ("bullet_graphs_unfused", {}, {"BULLET_RAY_DISABLE_FUSED_KERNELS": "1"}),
]


def main() -> int:
    from bullet_ray.gpu.mps import MpsDaemon

    only = sys.argv[1].split(",") if len(sys.argv) > 1 else None
    mps = MpsDaemon(f"check-{os.getpid()}")
    mps.start()
    os.environ.update(mps.env())
    prompts = [[(i * 13 + j) % 30000 + 100 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    # cuBLAS on both sides (prefill_gemm: cublas): the variants differ only in what each names
    base = EngineConfig(model=MODEL, device="cuda", schedule="bullet", kv_cache_memory_gb=16.0, max_num_seqs=64,
                        prefill_gemm="cublas")
    tokens: dict[str, list[list[int]]] = {}
    result: dict[str, Any] = {"prompt_lengths": list(PROMPT_LENGTHS), "num_new_tokens": NUM_NEW, "variants": {}}
    try:
        for name, changes, env in VARIANTS:
            if only and name not in only and name != "chunked":
                continue
            t0 = time.monotonic()
            try:
                with environment(env), LLMEngine(base.replace(**changes)) as engine:
                    tokens[name] = [o.token_ids for o in engine.generate(prompts, params)]
            except Exception as exc:  # noqa: BLE001 - record and go on with the next variant
                result["variants"][name] = {"error": repr(exc)}
                print(name, "failed", repr(exc), flush=True)
                continue
            ref = tokens.get("chunked", tokens[name])
            agree = [sum(a == b for a, b in zip(x, y)) / max(1, len(x)) for x, y in zip(tokens[name], ref)]
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens[name], ref)]
            result["variants"][name] = {"config": changes, "env": env, "seconds": round(time.monotonic() - t0, 1),
                                        "equal_to_chunked": tokens[name] == ref, "agreement": agree,
                                        "first_divergence": first, "first_tokens": [t[:6] for t in tokens[name]]}
            print(name, result["variants"][name], flush=True)
    finally:
        save("gpu_engine_schedule_check_h100", result)
        mps.stop(timeout_s=5)
    for name, r in result["variants"].items():
        print(f"{name:28} equal={r.get('equal_to_chunked')} first divergence {r.get('first_divergence')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
