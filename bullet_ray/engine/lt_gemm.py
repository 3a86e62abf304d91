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

The algorithm runs with the descriptor it was found with (with or without the target: the target can change the
launch as well as the choice) and one workspace shared by every partition: the prefill side runs one step at a
time, and a step on a new partition waits for the last (`WorkerBase.launch`).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bullet_ray.gpu.cublaslt_ids import ALGO_CONFIG_ATTRS, CLUSTER_IDS

logger = logging.getLogger(__name__)

CLUSTER_SHAPE_ATTR = next(value for name, value, _ in ALGO_CONFIG_ATTRS if name == "cluster_shape_id")

# a decoder layer's projections, as (submodule, attribute) of the layer
PROJECTION_MODULES = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"),
                      "gate_up": ("mlp", "gate_up_proj"), "down": ("mlp", "down_proj")}
# rows timed per partition and shape (those within the step cap); a call runs the choice of the nearest count within
# a factor ROUTE_RATIO, else F.linear (an algorithm is never used far from the row count it was timed at)
TUNE_TOKENS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
# and on the whole GPU (the chunked schedule's worker, whose decode-only steps are its own) decode batches' rows too:
# small-M GEMMs are bandwidth-bound, and cuBLAS's split-K choice for them may not be the fastest
WHOLE_GPU_ROWS: tuple[int, ...] = (16, 32, 64, 128)
ROUTE_RATIO = math.sqrt(2)
MARGIN = 0.02  # an algorithm must beat F.linear by this to be kept: repeated timings vary by ~1%
MAX_REL_ERR = 0.02  # max |y - F.linear| / max |F.linear| an algorithm may show (bf16, fp32 accumulation)
WORKSPACE_BYTES = 32 << 20
ALGO_BYTES = 64  # sizeof(cublasLtMatmulAlgo_t)
WHOLE_GPU = 0  # the place key of a worker on the whole GPU (the chunked schedule's): stream None's handle
MIN_WAVE_EFFICIENCY = 0.9  # partitions where cuBLAS's device-sized grid keeps less busy are tuned (tuned_places)
MAX_DESCRIPTORS = 4096  # the router's descriptors (one per row count, shape and target) before it starts afresh
CACHE_VERSION = 1  # raise with any change to how a point is chosen (candidates, MARGIN, MAX_REL_ERR, timing)
HEURISTIC_COUNT = 16  # algorithms asked of the heuristic per descriptor
# the heuristic's first algorithms per descriptor are also tried with each of these cluster shapes: on a partition the
# whole GPU's kernel (clusters of two, 132 CTAs) may fit the partition's grid best with its own tile and a small cluster
CLUSTER_VARIANTS: tuple[str, ...] = ("1x1x1", "1x2x1", "2x1x1")
VARIANT_SOURCES = 4
ENUMERATED_COUNT = 24  # enumerated configurations timed per point (cublaslt-all)
REPEATS, WARMUP = 10, 2
# every candidate is screened with SCREEN_REPEATS launches after one warm-up; the FINALISTS fastest are timed in full
# (a point offers up to ~60 candidates, and on a small partition a 4,096-token gate_up takes ~12 ms)
SCREEN_REPEATS, FINALISTS = 2, 3
# the GPU sleeps this many cycles (~1 ms) before each timing while the host enqueues the launches: the events then
# time the device only, not the host's ctypes call (which costs more than F.linear's and would decide small GEMMs)
HOLD_CYCLES = 2_000_000


@dataclass(frozen=True)
class Choice:
    """What one (partition, shape, token count) point chose."""
    tokens: int
    algo: bytes | None  # the cublasLtMatmulAlgo_t's 64 bytes; None: F.linear
    sm_target: int  # the descriptor it was found with (0: no target)
    ms: float
    base_ms: float  # F.linear's
    label: str  # e.g. "algo66 tile 256x128 stages 64x4 cluster 1x2x1 splitK 1", or "F.linear"
    source: str = "f_linear"  # heuristic / cluster_variant / enumerated / f_linear
    candidates: int = 0  # algorithms timed

    @property
    def speedup(self) -> float:
        return self.base_ms / self.ms if self.ms > 0 else 1.0


@dataclass(frozen=True)
class Candidate:
    algo: bytes
    sm_target: int
    ms: float | None  # None: it failed to launch
    rel_err: float
    label: str
    source: str


def pick(tokens: int, base_ms: float, candidates: Iterable[Candidate], margin: float = MARGIN,
         max_rel_err: float = MAX_REL_ERR) -> Choice:
    """The fastest candidate that ran, matched F.linear within `max_rel_err` and beat it by more than `margin`;
    else F.linear."""
    timed = list(candidates)
    ran = [c for c in timed if c.ms is not None and c.rel_err <= max_rel_err]
    best = min(ran, key=lambda c: c.ms or math.inf, default=None)
    if best is None or best.ms is None or best.ms >= base_ms * (1.0 - margin):
        return Choice(tokens, None, 0, base_ms, base_ms, "F.linear", candidates=len(timed))
    return Choice(tokens, best.algo, best.sm_target, best.ms, base_ms, best.label, best.source, len(timed))


def tune_tokens(max_tokens: int, tokens: Sequence[int] = TUNE_TOKENS) -> list[int]:
    """The token counts timed for a step cap: those of `tokens` within it, and the cap itself where it lies past
    ROUTE_RATIO of the largest (none below the smallest of `tokens`)."""
    within = sorted(t for t in tokens if t <= max_tokens)
    if within and max_tokens > within[-1] * ROUTE_RATIO:
        within.append(max_tokens)
    return within


def nearest(choices: Sequence[Choice], rows: int) -> Choice | None:
    """The choice timed nearest to `rows` (in ratio; a tie goes to the larger count), if within ROUTE_RATIO."""
    if rows <= 0 or not choices:
        return None
    best = min(choices, key=lambda c: (abs(math.log(c.tokens / rows)), -c.tokens))
    return best if max(best.tokens / rows, rows / best.tokens) <= ROUTE_RATIO + 1e-9 else None


def wave_efficiency(sms: int, grid: int) -> float:
    """The share of a partition's SM-rounds a persistent kernel of `grid` CTAs (one per SM) keeps busy:
    grid / (rounds x sms)."""
    return grid / (math.ceil(grid / sms) * sms)


def tuned_places(partitions: Iterable[tuple[int, int, Any]], device_sms: int,
                 min_efficiency: float = MIN_WAVE_EFFICIENCY) -> list[Place]:
    """The partitions worth tuning, from (ladder index, prefill SMs, stream): those where cuBLAS's kernels, launched
    with one CTA per SM of the device, waste more than 1 - `min_efficiency` of the partition's SM-rounds. On a 132-SM
    H200: 116 SMs keep 57% busy (a 2,048-token qkv / o / down took 1.74x), 68 SMs 97% (they kept the whole GPU's
    per-SM speed, `benchmarks/results/prefill_kernels_h200/`), 60 SMs 73%, 44 SMs 100%."""
    return [Place(i, sms, stream) for i, sms, stream in partitions
            if stream is not None and sms < device_sms and wave_efficiency(sms, device_sms) < min_efficiency]


def projections(model: Any) -> dict[str, list[Any]]:
    """The modules of each projection over the model's decoder layers (the Llama family's names)."""
    out: dict[str, list[Any]] = {}
    for layer in model.model.layers:
        for proj, (sub, attr) in PROJECTION_MODULES.items():
            out.setdefault(proj, []).append(getattr(getattr(layer, sub), attr))
    return out


def rel_error(y: Any, ref: Any) -> float:
    """max |y - ref| / max |ref|, in float32."""
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


class LtLib:
    """torch's libcublasLt, one handle and one workspace (`open` on the GPU; tests build one around fakes)."""

    def __init__(self, make_gemm: Callable[[int, int, int, int], Any], workspace: Any, describe: Callable[[Any], str],
                 with_cluster: Callable[[bytes, str], bytes | None] = lambda raw, cluster: None,
                 close: Callable[[], None] = lambda: None, version: str = ""):
        self.make_gemm, self.workspace, self.describe, self._close = make_gemm, workspace, describe, close
        self.version = version  # cuBLASLt's (a cached choice holds for this version only)
        self.with_cluster = with_cluster  # (algorithm, cluster shape name) -> the algorithm with it, None if refused

    @classmethod
    def open(cls, workspace_bytes: int = WORKSPACE_BYTES) -> LtLib:
        import torch
        import torch.nn.functional as F

        from bullet_ray.gpu import cublaslt

        probe = torch.ones(64, 64, device="cuda", dtype=torch.bfloat16)
        F.linear(probe, probe)  # torch loads cuBLAS / cuBLASLt now
        torch.cuda.synchronize()
        lib, path = cublaslt.load_cublaslt()
        handle = ctypes.c_void_p()
        cublaslt.check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
        logger.info("cuBLASLt %s from %s", lib.cublasLtGetVersion(), path)
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")

        def describe(algo: Any) -> str:
            return cublaslt.describe(lib, cublaslt.MatmulAlgo.from_buffer_copy(bytes(algo))).label

        def with_cluster(raw: bytes, cluster: str) -> bytes | None:
            try:
                return bytes(cublaslt.with_settings(lib, cublaslt.MatmulAlgo.from_buffer_copy(raw),
                                                    [(CLUSTER_SHAPE_ATTR, CLUSTER_IDS[cluster])]))
            except cublaslt.CublasLtError:
                return None
        return cls(functools.partial(cublaslt.LinearGemm, lib, handle), workspace, describe, with_cluster,
                   lambda: lib.cublasLtDestroy(handle), version=str(lib.cublasLtGetVersion()))

    def close(self) -> None:
        self._close()


class LtGemmRouter:
    """The projections' forward through the tuned algorithms. `choices[(place, n, k)]`: the Choices of one place and
    one weight shape [n, k]. A partition is keyed by its stream's handle (`place_of()` at call time: the current
    stream's, by default); a worker on the whole GPU has one place, whatever stream a capture uses (`place_of`
    constant: `WHOLE_GPU`). Launches go to the current stream (`stream_of()`)."""

    def __init__(self, lt: LtLib, choices: dict[tuple[int, int, int], list[Choice]],
                 place_of: Callable[[], int] | None = None, stream_of: Callable[[], int] | None = None):
        self.lt = lt
        self.place_of = place_of or _current_stream_handle
        self.stream_of = stream_of or _current_stream_handle
        self._gemms: dict[tuple[int, int, int, int], Any] = {}
        self._plans: dict[tuple[int, int, int, int], tuple[Any, Any, Choice] | None] = {}  # (place, n, k, rows)
        self.use(choices)
        self.calls = {"routed": 0, "f_linear": 0, "check_refused": 0, "launch_failed": 0}
        self._routed: list[Any] = []

    def route(self, model: Any, only: set[tuple[int, int]] | None = None) -> set[tuple[int, int]]:
        """Every projection of the model (of a weight shape in `only`, if given) through `linear` (forward and
        gemm_into), as instance attributes; returns the weight shapes [n, k] routed (what a tuner times)."""
        import torch

        if self._routed:
            raise RuntimeError("the projections are routed already")
        for mods in projections(model).values():
            for mod in mods:
                if mod.bias is not None or mod.weight.dtype != torch.bfloat16 or (
                        only is not None and tuple(mod.weight.shape) not in only):
                    continue  # biased projections keep F.linear; the descriptors are bf16
                mod.forward = functools.partial(self.linear, mod.weight)
                mod.gemm_into = functools.partial(self._into, mod.weight)
                self._routed.append(mod)
        return {tuple(mod.weight.shape) for mod in self._routed}  # type: ignore[misc]

    def use(self, choices: dict[tuple[int, int, int], list[Choice]]) -> None:
        """Route by these choices from now on (the plans made so far are dropped)."""
        self.choices = {key: sorted(c, key=lambda x: x.tokens) for key, c in choices.items()}
        self._plans.clear()

    def unroute(self) -> None:
        for mod in self._routed:
            del mod.forward, mod.gemm_into
        self._routed.clear()

    def _into(self, weight: Any, x: Any, out: Any) -> Any:
        return self.linear(weight, x, out)

    def linear(self, weight: Any, x: Any, out: Any = None) -> Any:
        """x @ weight.T (into `out` if given) with the place's chosen algorithm, or F.linear."""
        n, k = weight.shape
        rows = x.shape[0] if x.dim() == 2 else -1
        plan = None
        if rows > 0 and x.dtype == weight.dtype and x.is_contiguous() and (
                out is None or (out.is_contiguous() and out.dtype == x.dtype and tuple(out.shape) == (rows, n))):
            key = (self.place_of(), n, k, rows)
            if key in self._plans:
                plan = self._plans[key]
            elif not self._capturing():  # planning (descriptors, AlgoCheck) only outside a graph capture
                plan = self._plan(key)
        if plan is not None:
            gemm, algo, choice = plan
            y = out if out is not None else x.new_empty(rows, n)
            if self.launch(gemm, algo, weight, x, y, self.stream_of()):
                self.calls["routed"] += 1
                return y
            self.calls["launch_failed"] += 1
            self._plans[key] = None  # never again for this row count (a graph capture would not survive a failure)
            logger.warning("cublasLtMatmul failed (%d x %d x %d, %s): F.linear for these rows", rows, n, k,
                           choice.label)
        self.calls["f_linear"] += 1
        if out is None:
            return x @ weight.t()
        import torch

        return torch.mm(x, weight.t(), out=out)

    def _capturing(self) -> bool:
        """Whether the current stream is capturing a CUDA graph (no cuBLASLt set-up calls then: such a call ran
        unplanned falls back to F.linear; captures warm each shape up first, so it does not happen)."""
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    def _plan(self, key: tuple[int, int, int, int]) -> tuple[Any, Any, Choice] | None:
        """(descriptors, algorithm struct, choice) for a call of `rows` rows on a place and shape, or None (F.linear):
        the nearest timed choice, its algorithm checked by cublasLtMatmulAlgoCheck for exactly these rows. Made once
        per key: CUDA graph captures make millions of calls."""
        place, n, k, rows = key
        choice = nearest(self.choices.get((place, n, k), ()), rows)
        plan = None
        if choice is not None and choice.algo is not None:
            gemm, algo = self._gemm(rows, n, k, choice.sm_target), _algo(choice.algo)
            status, result = gemm.check_algo(algo)
            if status == 0 and result.workspaceSize <= self.lt.workspace.numel():
                plan = (gemm, algo, choice)
            else:
                self.calls["check_refused"] += 1
        self._plans[key] = plan
        return plan

    def _gemm(self, m: int, n: int, k: int, sm_target: int) -> Any:
        key = (m, n, k, sm_target)
        if key not in self._gemms:
            if len(self._gemms) >= MAX_DESCRIPTORS:  # eager steps of every row count: start afresh, lazily again
                self._forget()
            self._gemms[key] = self.lt.make_gemm(m, n, k, sm_target)
        return self._gemms[key]

    def _forget(self) -> None:
        """Close every descriptor and drop every plan (captured graphs keep their launches; eager calls plan again)."""
        for gemm in self._gemms.values():
            gemm.close()
        self._gemms.clear()
        self._plans.clear()

    def launch(self, gemm: Any, algo: Any, weight: Any, x: Any, y: Any, stream: int) -> bool:
        """y = x weight^T with `algo` (a cublasLtMatmulAlgo_t) on `stream` (a cudaStream_t); False when cuBLASLt
        refused the launch."""
        ws = self.lt.workspace
        return gemm.run(algo, weight.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), ws.numel(), stream) == 0

    def report(self) -> dict[str, Any]:
        chosen = [c for cs in self.choices.values() for c in cs]
        kept = [c for c in chosen if c.algo is not None]
        return {"points": len(chosen), "kept": len(kept),
                "kept_speedup_median": round(sorted(c.speedup for c in kept)[len(kept) // 2], 3) if kept else None,
                "by_source": {s: sum(c.source == s for c in kept) for s in ("heuristic", "cluster_variant",
                                                                                "enumerated")},
                "calls": dict(self.calls)}

    def close(self) -> None:
        """Unroute the projections, close the descriptors and the library handle."""
        self.unroute()
        self._forget()
        self.lt.close()


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
        save_cache(cache, tuner.cache)  # what was timed counts for the next start, even if this one failed
        torch.cuda.empty_cache()  # the tuning's operands, cached per partition stream, before any capture
    return router, {"gemm": mode, "tokens": tokens, "device_sms": device_sms, **router.report(),
                    "cached": sum(row["cached"] for row in tuner.log), "cache": str(cache), "choices": tuner.log}


def _algo(raw: bytes) -> Any:
    from bullet_ray.gpu.cublaslt import MatmulAlgo

    return MatmulAlgo.from_buffer_copy(raw)


def _release_cached_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _current_stream_handle() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


@dataclass
class Place:
    """A partition the prefill side runs on: its ladder index, SMs and stream."""
    index: int
    sms: int
    stream: Any


@dataclass
class LtGemmTuner:
    """Times the candidates of every (place, shape, token count) point and returns the router's choices."""
    lt: LtLib
    device_sms: int
    enumerate: bool = False  # cublaslt-all: the bounded enumeration too
    margin: float = MARGIN  # how much faster than F.linear a choice must be (a test forces one with a negative one)
    time_ms: Callable[[Callable[[], Any], Any], float] | None = None  # (launch, stream) -> ms; None: CUDA events
    screen_ms: Callable[[Callable[[], Any], Any], float] | None = None  # the short timing every candidate gets
    log: list[dict[str, Any]] = field(default_factory=list)  # one row per point (the Ready info's summary)
    # earlier choices by `cache_key` (load_cache); a point found there is not timed again, a new one is added
    cache: dict[str, dict[str, Any]] = field(default_factory=dict)
    cache_prefix: str = ""  # what else a cached choice depends on: device, cuBLASLt version, mode (worker's)
    _enumerated: dict[tuple[int, int], list[tuple[bytes, str]]] = field(default_factory=dict)

    def tune(self, places: Sequence[Place], shapes: Iterable[tuple[int, int]], tokens: Sequence[int],
             progress: Callable[[Iterable[Any]], Iterable[Any]] = lambda it: it) -> dict[tuple[int, int, int],
                                                                                      list[Choice]]:
        """{(place stream handle, n, k): [Choice per token count]} over every point."""
        choices: dict[tuple[int, int, int], list[Choice]] = {}
        points = [(p, s, t) for p in places for s in sorted(set(shapes)) for t in tokens]
        last_place = None
        for place, (n, k), t in progress(points):
            if last_place is not None and place is not last_place:
                _release_cached_memory()  # the last place's operands were cached for its stream alone
            last_place = place
            key = cache_key(self.cache_prefix, place.sms, n, k, t)
            choice = _cached_choice(self.cache.get(key))
            cached = choice is not None
            if choice is None:
                choice = self.tune_point(place, t, n, k)
            self.cache[key] = choice_to_dict(choice)
            choices.setdefault((place_key(place.stream), n, k), []).append(choice)
            self.log.append({"index": place.index, "sms": place.sms, "n": n, "k": k, "cached": cached,
                             **choice_to_dict(choice)})
        return choices

    def tune_point(self, place: Place, m: int, n: int, k: int) -> Choice:
        """F.linear against every candidate for one GEMM on one place: each candidate is launched once, checked against
        F.linear and screened with a short timing; the FINALISTS fastest are then timed as F.linear is."""
        import torch
        import torch.nn.functional as F

        from bullet_ray.gpu.cublaslt import CublasLtError, dedupe

        with torch.cuda.stream(place.stream):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
        timer, screen = self.time_ms or _event_ms, self.screen_ms or _screen_ms
        base_ms = timer(lambda: F.linear(x, w), place.stream)
        ws = self.lt.workspace
        screened: list[tuple[Candidate, Callable[[], int]]] = []
        gemms = []
        try:
            for target in ([0] if place.sms >= self.device_sms else [0, place.sms]):
                try:
                    gemm = self.lt.make_gemm(m, n, k, target)
                    gemms.append(gemm)
                    found = [(bytes(r.algo), "heuristic")
                             for _, r in dedupe(gemm.heuristics(ws.numel(), HEURISTIC_COUNT))]
                    found += self._cluster_variants([raw for raw, _ in found[:VARIANT_SOURCES]], {a for a, _ in found})
                    if self.enumerate:  # found once per shape; each is checked against this descriptor below
                        try:
                            found += self._enumerated_for(n, k, m, {a for a, _ in found})
                        except CublasLtError as e:  # the heuristic's candidates still count
                            logger.warning("cuBLASLt enumeration %dx%d failed: %s", n, k, e)
                    for raw, source in found:
                        status, result = gemm.check_algo(_algo(raw))
                        if status == 0 and result.workspaceSize <= ws.numel():
                            screened.append(self._screen(gemm, raw, target, source, w, x, y, ref, place.stream, screen))
                except CublasLtError as e:  # a descriptor or query this GEMM cannot take: the others still count
                    logger.warning("cuBLASLt tuning %dx%dx%d on %d SMs (target %d): %s", m, n, k, place.sms, target, e)
            ran = sorted(((c, fn) for c, fn in screened if c.ms is not None and c.rel_err <= MAX_REL_ERR),
                         key=lambda pair: pair[0].ms or math.inf)
            finalists = []
            for c, fn in ran[:FINALISTS]:
                try:
                    finalists.append(replace(c, ms=timer(fn, place.stream)))
                except RuntimeError as e:  # a launch refused while timed: not a candidate
                    logger.warning("cuBLASLt candidate %s (target %d) failed while timed: %s", c.label, c.sm_target, e)
        finally:
            for gemm in gemms:
                gemm.close()
        return replace(pick(m, base_ms, finalists, self.margin), candidates=len(screened))

    def _screen(self, gemm: Any, raw: bytes, target: int, source: str, w: Any, x: Any, y: Any, ref: Any, stream: Any,
                screen: Callable[[Callable[[], Any], Any], float]) -> tuple[Candidate, Callable[[], int]]:
        """(the candidate with its error against F.linear and its screening time, its launch)."""
        import torch

        algo, ws = _algo(raw), self.lt.workspace
        handle = int(stream.cuda_stream) if stream is not None else _current_stream_handle()

        def launch() -> int:
            return int(gemm.run(algo, w.data_ptr(), x.data_ptr(), y.data_ptr(), ws.data_ptr(), ws.numel(), handle))

        def timed() -> int:  # a launch refused while timed would otherwise time as ~0 ms
            status = launch()
            if status != 0:
                raise RuntimeError(f"cublasLtMatmul returned {status}")
            return status
        try:
            with torch.cuda.stream(stream):  # checked on the stream it ran on
                y.zero_()
                if launch() != 0:
                    return Candidate(raw, target, None, math.inf, "launch refused", source), timed
                err = rel_error(y, ref)
            return Candidate(raw, target, screen(timed, stream), err, self.lt.describe(raw), source), timed
        except RuntimeError as e:  # e.g. a configuration the check passed and the launch did not take
            logger.warning("cuBLASLt candidate %s (target %d) failed: %s", self.lt.describe(raw), target, e)
            return Candidate(raw, target, None, math.inf, "failed", source), timed

    def _cluster_variants(self, sources: list[bytes], known: set[bytes]) -> list[tuple[bytes, str]]:
        """Each source algorithm with each of CLUSTER_VARIANTS' cluster shapes, those not already known."""
        out = []
        for raw in sources:
            for cluster in CLUSTER_VARIANTS:
                variant = self.lt.with_cluster(raw, cluster)
                if variant is not None and variant not in known:
                    known.add(variant)
                    out.append((variant, "cluster_variant"))
        return out

    def _enumerated_for(self, n: int, k: int, m: int, known: set[bytes]) -> list[tuple[bytes, str]]:
        """Up to ENUMERATED_COUNT configurations of the shape's bounded enumeration (1x1 and 1x2 clusters, two stages
        ids per tile) that the heuristic did not return; enumerated once per shape, at the first token count."""
        from bullet_ray.gpu.cublaslt_ids import EnumBounds

        if (n, k) not in self._enumerated:
            bounds = EnumBounds(max_stages=2, cluster_shape_ids=(CLUSTER_IDS["1x1x1"], CLUSTER_IDS["1x2x1"]),
                                max_checks=2000)
            started = time.perf_counter()
            gemm = self.lt.make_gemm(m, n, k, 0)
            try:
                found = gemm.enumerate(bounds, self.lt.workspace.numel())
            finally:
                gemm.close()
            self._enumerated[(n, k)] = [(bytes(r.algo), "enumerated") for r in found.results]
            logger.info("cuBLASLt enumeration %dx%d: %d valid of %d checked in %.1f s", n, k, len(found.results),
                        found.num_checked, time.perf_counter() - started)
        fresh = [(a, s) for a, s in self._enumerated[(n, k)] if a not in known]
        return fresh[:ENUMERATED_COUNT]


def cache_key(prefix: str, sms: int, n: int, k: int, tokens: int) -> str:
    return f"{prefix}|sms {sms}|{n}x{k}|{tokens} rows"


def choice_to_dict(choice: Choice) -> dict[str, Any]:
    return {**asdict(choice), "algo": None if choice.algo is None else choice.algo.hex()}


def _cached_choice(row: Any) -> Choice | None:
    """A cache row as a Choice; None when there is none or it is not one (a damaged row is timed again)."""
    if row is None:
        return None
    try:
        return choice_from_dict(row)
    except (KeyError, TypeError, ValueError):
        return None


def choice_from_dict(row: dict[str, Any]) -> Choice:
    fields = {k: row[k] for k in ("tokens", "sm_target", "ms", "base_ms", "label", "source", "candidates")}
    algo = None if row["algo"] is None else bytes.fromhex(row["algo"])
    if algo is not None and len(algo) != ALGO_BYTES:
        raise ValueError(f"an algorithm is {ALGO_BYTES} bytes, the row has {len(algo)}")
    return Choice(algo=algo, **fields)


def cache_path() -> Path | None:
    """The choices' cache: BULLET_RAY_LT_GEMM_CACHE (a JSON file; "off": none), else
    ~/.cache/bullet_ray/lt_gemm.json. A later start on the same device, cuBLASLt and mode times only what is new (and
    runs the same algorithms: serving runs compared with each other do not differ by their tuning's noise)."""
    value = os.environ.get("BULLET_RAY_LT_GEMM_CACHE", "")
    if value.lower() in ("off", "0"):
        return None
    if value:
        return Path(value)
    try:
        return Path.home() / ".cache" / "bullet_ray" / "lt_gemm.json"
    except RuntimeError:  # no home to resolve: no cache
        return None


def load_cache(path: Path | None) -> dict[str, dict[str, Any]]:
    """The cached choices at `path` ({} when there is none or it cannot be read: it is only a cache)."""
    if path is None:
        return {}
    try:
        if not path.exists():
            return {}
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        logger.warning("the cuBLASLt choices' cache %s was not read (%s): tuning afresh", path, e)
        return {}


def save_cache(path: Path | None, cache: dict[str, dict[str, Any]]) -> None:
    """Write the cache over what the file holds now (another engine on the node may have added to it since this one
    read it), atomically; a failure is logged, never raised."""
    if path is None:
        return
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f"{path.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # read, merge and replace as one: engines on a node start together
            tmp.write_text(json.dumps({**load_cache(path), **cache}, indent=0, sort_keys=True))
            os.replace(tmp, path)
    except OSError as e:
        logger.warning("the cuBLASLt choices' cache %s was not written: %s", path, e)
        tmp.unlink(missing_ok=True)


def place_key(stream: Any) -> int:
    """The router's key of a place: a partition's stream handle, WHOLE_GPU for stream None (the whole GPU)."""
    return int(stream.cuda_stream) if stream is not None else WHOLE_GPU


def _screen_ms(fn: Callable[[], Any], stream: Any) -> float:
    return _event_ms(fn, stream, SCREEN_REPEATS, 1)


def _event_ms(fn: Callable[[], Any], stream: Any, repeats: int = REPEATS, warmup: int = WARMUP) -> float:
    """Milliseconds per call of fn() launched back to back on `stream`, from CUDA events."""
    import torch

    with torch.cuda.stream(stream):
        torch.cuda._sleep(HOLD_CYCLES)  # the launches below queue up behind it
        for _ in range(warmup):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / repeats
