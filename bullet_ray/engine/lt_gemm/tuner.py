"""The tuning half of `engine.prefill_gemm: cublaslt` (the package docstring says the whole): `LtGemmTuner` times
F.linear and cuBLASLt's candidate algorithms per (place, shape, row count) and picks (`pick`); which partitions are
worth it (`tuned_places`, `wave_efficiency`) and which row counts (`tune_tokens`)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from bullet_ray.engine.lt_gemm.cache import cache_key, cached_choice, choice_to_dict
from bullet_ray.engine.lt_gemm.router import (
    ROUTE_RATIO,
    Choice,
    LtLib,
    _algo,
    _current_stream_handle,
    place_key,
)
from bullet_ray.gpu.cublaslt_ids import CLUSTER_IDS

logger = logging.getLogger(__name__)

# rows timed per partition and shape (those within the step cap)
TUNE_TOKENS: tuple[int, ...] = (256, 512, 1024, 2048, 4096, 8192)
# and on the whole GPU (the chunked schedule's worker, whose decode-only steps are its own) decode batches' rows too:
# small-M GEMMs are bandwidth-bound, and cuBLAS's split-K choice for them may not be the fastest
WHOLE_GPU_ROWS: tuple[int, ...] = (16, 32, 64, 128)
MARGIN = 0.02  # an algorithm must beat F.linear by this to be kept: repeated timings vary by ~1%
MAX_REL_ERR = 0.02  # max |y - F.linear| / max |F.linear| an algorithm may show (bf16, fp32 accumulation)
MIN_WAVE_EFFICIENCY = 0.9  # partitions where cuBLAS's device-sized grid keeps less busy are tuned (tuned_places)
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


def cluster_variants(with_cluster: Callable[[bytes, str], bytes | None], sources: Sequence[bytes],
                     known: set[bytes]) -> list[tuple[int, bytes]]:
    """(rank of the source, variant) of each source algorithm with each of CLUSTER_VARIANTS' cluster shapes that the
    library takes and that is not in `known` (which grows): the engine's tuner and `benchmarks/gpu/lt_algos.py` try
    the same."""
    out = []
    for rank, raw in enumerate(sources):
        for cluster in CLUSTER_VARIANTS:
            variant = with_cluster(raw, cluster)
            if variant is not None and variant not in known:
                known.add(variant)
                out.append((rank, variant))
    return out


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


def rel_error(y: Any, ref: Any) -> float:
    """max |y - ref| / max |ref|, in float32."""
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-12))


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
            choice = cached_choice(self.cache.get(key))
            cached = choice is not None
            if choice is None:
                choice = self.tune_point(place, t, n, k)
            row = choice_to_dict(choice)
            self.cache[key] = row
            choices.setdefault((place_key(place.stream), n, k), []).append(choice)
            self.log.append({"index": place.index, "sms": place.sms, "n": n, "k": k, "cached": cached, **row})
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
                    found += [(v, "cluster_variant") for _, v in cluster_variants(
                        self.lt.with_cluster, [raw for raw, _ in found[:VARIANT_SOURCES]], {a for a, _ in found})]
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


def _release_cached_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
