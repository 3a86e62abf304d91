"""`engine.prefill_gemm: cublaslt`: the prefill worker's projections (qkv, o, gate_up, down) launched with the
cuBLASLt algorithm that ran fastest on each SM partition, chosen by timing at start.

Why: cuBLAS picks its GEMM kernels for the whole device. On an H200 (132 SMs) its kernels for a prefill step's
projections launch 132 CTAs in clusters of two; on a green-context partition of 84-124 SMs the CTAs that find no SM
wait for a second round, and a 2,048-token step takes 64.8-71.9 ms against 50.7 ms on the whole GPU
(`benchmarks/results/prefill_kernels_h200/`). cuBLASLt's heuristic returns other algorithms for the same GEMM, and
with CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET set to the partition's SMs it sizes their grids for it;
`benchmarks/gpu/lt_algos.py` times every one per place. This module makes the engine use the winner.

At start (`LtGemmTuner.tune`, on the prefill worker before its piecewise graphs are tuned or captured, alone on the
GPU) for every partition the prefill side may run on where cuBLAS's device-sized grid wastes SM-rounds
(`tuned_places`; the chunked schedule's one worker: the whole GPU, one place), every distinct projection shape and
every token count of `TUNE_TOKENS` (up to the step cap): F.linear is timed on the partition's stream, then each
candidate algorithm
(the heuristic's, asked without and with the SM-count target; its first few again with clusters of 1x1, 1x2 and 2x1,
the whole GPU's kernel with a grid that may fit the partition; with `cublaslt-all` also the bounded enumeration of
`bullet_ray.gpu.cublaslt_ids`, once per shape), its output checked against F.linear's and its time screened with two
launches; the three fastest are timed as F.linear is. The fastest of those is kept only if it beats F.linear by
`MARGIN`; else the point keeps F.linear. `LtGemmRouter` then replaces each projection's forward
(and `gemm_into`, which `layers.linear_into` calls with a CUDA graph's buffer): a call on a tuned partition's stream
runs the choice of the nearest tuned token count within a factor ROUTE_RATIO (its algorithm checked once for the
call's exact rows with cublasLtMatmulAlgoCheck), anything else F.linear. CUDA graphs captured afterwards keep the
algorithm. On the chunked schedule the worker also times decode batches' row counts (`WHOLE_GPU_ROWS`, 16-128), so
every step of 12 rows or more is routed, decode-only steps included; below that F.linear.

The choices are cached (`cache_path`: BULLET_RAY_LT_GEMM_CACHE, default ~/.cache/bullet_ray/lt_gemm.json) by device,
SM count, cuBLASLt and torch version, mode, partition size, shape and token count: a later start times only what is
new, and runs the same algorithms as the last (serving runs compared with each other do not differ by tuning noise).

The package: `router.py` (`LtGemmRouter`, `LtLib`, `Choice`), `tuner.py` (`LtGemmTuner`, `pick`, `tuned_places`,
`tune_tokens`), `cache.py` (the choices' file); this file's `tune_and_route` is the one entry the prefill worker,
`bullet-ray profile` and `benchmarks/gpu/engine_speed.py` call.

The algorithm runs with the descriptor it was found with (with or without the target: the target can change the
launch as well as the choice) and one workspace shared by every partition: the prefill side runs one step at a
time, and a step on a new partition waits for the last (`WorkerBase.launch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from bullet_ray.engine.lt_gemm.cache import CACHE_VERSION, cache_path, load_cache, save_cache
from bullet_ray.engine.lt_gemm.router import (
    PROJECTION_MODULES,
    WHOLE_GPU,
    Choice,
    LtGemmRouter,
    LtLib,
    place_key,
    projections,
)
from bullet_ray.engine.lt_gemm.tuner import (
    TUNE_TOKENS,
    WHOLE_GPU_ROWS,
    LtGemmTuner,
    Place,
    rel_error,
    tune_tokens,
    tuned_places,
    wave_efficiency,
)

__all__ = ["CACHE_VERSION", "PROJECTION_MODULES", "TUNE_TOKENS", "WHOLE_GPU", "Choice", "LtGemmRouter", "LtGemmTuner",
           "LtLib", "Place", "cache_path", "load_cache", "place_key", "projections", "rel_error", "save_cache",
           "tune_and_route", "tune_tokens", "tuned_places", "wave_efficiency"]


def tune_and_route(model: Any, places: Sequence[Place], mode: str, max_tokens: int, device: Any, device_sms: int,
                   whole: bool = False, progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it,
                   ) -> tuple[LtGemmRouter, dict[str, Any]] | None:
    """`prefill_gemm` `mode` (cublaslt / cublaslt-all) for a model on a GPU: route its projections, time the choices on
    `places` (the cache's first), and return (the router, a report: counts and every point's choice); None when there
    is nothing to tune. `whole`: one place, the whole GPU, whatever stream a call runs on. ConfigError (naming
    prefill_gemm) without torch's libcublasLt. The engine's prefill worker and `bullet-ray profile` call it."""
    import torch

    from bullet_ray.errors import ConfigError

    tokens = tune_tokens(max_tokens, (*WHOLE_GPU_ROWS, *TUNE_TOKENS) if whole else TUNE_TOKENS)
    if not places or not tokens:
        return None
    try:
        lt = LtLib.open()
    except (OSError, RuntimeError, AttributeError) as e:  # AttributeError: a libcublasLt without a function we call
        raise ConfigError("prefill_gemm", f"{mode} needs torch's libcublasLt: {e}") from e
    cache = cache_path()
    tuner = LtGemmTuner(lt, device_sms, enumerate=mode == "cublaslt-all", cache=load_cache(cache),
                        cache_prefix=f"v{CACHE_VERSION}|{torch.cuda.get_device_name(device)}|{device_sms} SMs|"
                                     f"cuBLASLt {lt.version}|torch {torch.__version__}|{mode}")
    router = LtGemmRouter(lt, {}, place_of=(lambda: WHOLE_GPU) if whole else None)
    try:
        shapes = router.route(model)  # the shapes of the projections it routes (bf16, no bias)
        if not shapes:
            router.close()
            return None
        router.use(tuner.tune(places, shapes, tokens, progress))
    except BaseException:
        router.close()  # nothing left routed, the handle released
        raise
    finally:
        # what was timed counts for the next start, even if this one failed; a start that timed nothing writes nothing
        if not all(row["cached"] for row in tuner.log):
            save_cache(cache, tuner.cache)
        torch.cuda.empty_cache()  # the tuning's operands, cached per partition stream, before any capture
    return router, {"gemm": mode, "tokens": tokens, "device_sms": device_sms, **router.report(),
                    "cached": sum(row["cached"] for row in tuner.log), "cache": str(cache), "choices": tuner.log}
