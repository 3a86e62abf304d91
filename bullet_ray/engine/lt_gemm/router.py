"""The routing half of `engine.prefill_gemm: cublaslt` (the package docstring says the whole): `LtGemmRouter`
replaces each projection's forward (and `gemm_into`) with a call that launches the tuned cuBLASLt algorithm of the
current place (a partition's stream, or the whole GPU) and the nearest timed row count, or F.linear; `LtLib` is
torch's libcublasLt with one handle and one workspace; `Choice` is what a tuned point chose."""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# a decoder layer's projections, as (submodule, attribute) of the layer
PROJECTION_MODULES = {"qkv": ("self_attn", "qkv_proj"), "o": ("self_attn", "o_proj"),
                      "gate_up": ("mlp", "gate_up_proj"), "down": ("mlp", "down_proj")}
# a call runs the choice of the nearest timed row count within this factor, else F.linear (an algorithm is never used
# far from the row count it was timed at)
ROUTE_RATIO = math.sqrt(2)
WORKSPACE_BYTES = 32 << 20
ALGO_BYTES = 64  # sizeof(cublasLtMatmulAlgo_t)
ALIGNMENT = 256  # bytes: CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES' default, what the heuristic assumes
WHOLE_GPU = 0  # the place key of a worker on the whole GPU (the chunked schedule's): stream None's handle
MAX_DESCRIPTORS = 4096  # the router's descriptors (one per row count, shape and target) before it starts afresh


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


def nearest(choices: Sequence[Choice], rows: int) -> Choice | None:
    """The choice timed nearest to `rows` (in ratio; a tie goes to the larger count), if within ROUTE_RATIO."""
    if rows <= 0 or not choices:
        return None
    best = min(choices, key=lambda c: (abs(math.log(c.tokens / rows)), -c.tokens))
    return best if max(best.tokens / rows, rows / best.tokens) <= ROUTE_RATIO + 1e-9 else None


def projections(model: Any) -> dict[str, list[Any]]:
    """The modules of each projection over the model's decoder layers (the Llama family's names)."""
    out: dict[str, list[Any]] = {}
    for layer in model.model.layers:
        for proj, (sub, attr) in PROJECTION_MODULES.items():
            out.setdefault(proj, []).append(getattr(getattr(layer, sub), attr))
    return out


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
        return cls(functools.partial(cublaslt.LinearGemm, lib, handle), workspace, describe,
                   functools.partial(cublaslt.with_cluster, lib),
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
                if mod.bias is not None or mod.weight.dtype != torch.bfloat16 or not mod.weight.is_contiguous() \
                        or not _aligned(mod.weight) or (only is not None and tuple(mod.weight.shape) not in only):
                    continue  # F.linear for biased projections; the descriptors are bf16, row-major, aligned
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
        if rows > 0 and x.dtype == weight.dtype and x.is_contiguous() and _aligned(x) and (
                out is None or (out.is_contiguous() and out.dtype == x.dtype and tuple(out.shape) == (rows, n)
                                and _aligned(out))):
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


def place_key(stream: Any) -> int:
    """The router's key of a place: a partition's stream handle, WHOLE_GPU for stream None (the whole GPU)."""
    return int(stream.cuda_stream) if stream is not None else WHOLE_GPU


def _aligned(t: Any) -> bool:
    """Whether a GPU tensor starts where cuBLASLt's heuristic assumed (ALIGNMENT bytes, its default); an algorithm
    chosen for aligned operands is not launched on others. (Host tensors only meet the tests' fake library.)"""
    return not t.is_cuda or t.data_ptr() % ALIGNMENT == 0


def _algo(raw: bytes) -> Any:
    from bullet_ray.gpu.cublaslt import MatmulAlgo

    return MatmulAlgo.from_buffer_copy(raw)


def _current_stream_handle() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)
