"""A ctypes binding to the libcublasLt that torch loaded: just what `benchmarks/gpu/lt_algos.py` needs to ask
cuBLASLt's heuristic for every algorithm of an `F.linear` GEMM, describe each one and launch it on a stream.

The GEMM is `F.linear(x, w)`: x [M=T, K], w [N, K], y [M, N], bf16, row-major. In cuBLASLt's column-major terms
D (N x M, ld N) = op(A) op(B) with A = w as K x N (ld K, TRANSA = T) and B = x as K x M (ld K, TRANSB = N);
compute CUBLAS_COMPUTE_32F, scale CUDA_R_32F, alpha 1, beta 0, C = D (`linear_layout`, `LinearGemm`).
Importing it needs neither torch nor CUDA; `load_cublaslt` needs torch to have run a GEMM on the GPU first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# ---- values from cublasLt.h and cublas_api.h (CUDA 12.6, and cuBLAS 13.10's from the pip nvidia-cublas wheel: the
# same values) and library_types.h (CUDA 13.0); the attribute sizes below are the ones libcublasLt 13.10 accepts
CUBLAS_STATUS_SUCCESS = 0
STATUS_NAMES = {0: "SUCCESS", 1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
                11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR", 15: "NOT_SUPPORTED",
                16: "LICENSE_ERROR"}  # cublasStatus_t
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1  # cublasOperation_t
CUBLAS_COMPUTE_32F = 68  # cublasComputeType_t
CUDA_R_32F, CUDA_R_16BF = 0, 14  # cudaDataType_t (library_types.h)
# cublasLtMatmulDescAttributes_t (each int32_t)
CUBLASLT_MATMUL_DESC_TRANSA = 3
CUBLASLT_MATMUL_DESC_TRANSB = 4
CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET = 15
CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t, uint64_t
# cublasLtMatmulAlgoConfigAttributes_t: (name, value, C type of the attribute)
ALGO_CONFIG_ATTRS: tuple[tuple[str, int, Any], ...] = (
    ("algo_id", 0, ctypes.c_int32),            # CUBLASLT_ALGO_CONFIG_ID
    ("tile_id", 1, ctypes.c_uint32),           # CUBLASLT_ALGO_CONFIG_TILE_ID
    ("splitk_num", 2, ctypes.c_int32),         # CUBLASLT_ALGO_CONFIG_SPLITK_NUM
    ("reduction_scheme", 3, ctypes.c_uint32),  # CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME
    ("cta_swizzling", 4, ctypes.c_uint32),     # CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING
    ("custom_option", 5, ctypes.c_uint32),     # CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION
    ("stages_id", 6, ctypes.c_uint32),         # CUBLASLT_ALGO_CONFIG_STAGES_ID
    ("inner_shape_id", 7, ctypes.c_uint16),    # CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID
    ("cluster_shape_id", 8, ctypes.c_uint16),  # CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID
)
# libcublasLt 13.10 on a CPU: ConfigSetAttribute takes exactly these sizes (the id none: read-only), and
# ConfigGetAttribute reads back what `configure` set
ALGO_CONFIG_TYPES = {value: ctype for _, value, ctype in ALGO_CONFIG_ATTRS}
# cublasLtMatmulAlgoCapAttributes_t (cuBLAS 13.10's cublasLt.h) read by `algo_caps`, with the C type each holds; the
# header has no capability for cluster shapes (NVIDIA's LtMatmulCustomFind sample tries every cublasLtClusterShape_t)
CUBLASLT_ALGO_CAP_SPLITK_SUPPORT = 0  # int32_t, 0: no split-K
CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK = 1  # uint32_t, a mask of cublasLtReductionScheme_t
CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT = 2  # uint32_t, 0: none, 1: CTA_SWIZZLING 1 allowed
CUBLASLT_ALGO_CAP_TILE_IDS = 6  # uint32_t array (size asked with sizeInBytes 0)
CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX = 7  # int32_t, CUSTOM_OPTION takes 0..this
CUBLASLT_ALGO_CAP_STAGES_IDS = 13  # uint32_t array
REDUCTION_NAMES = {0: "none", 1: "inplace", 2: "compute_type", 4: "output_type"}  # cublasLtReductionScheme_t
# cublasLtMatmulTile_t (cuBLAS 13.10's cublasLt.h, ids 0-645, "rows x cols" of the output tile): 0-35 by hand, then
# the header's runs, each every `rows x cols` with cols a multiple of `step` up to a maximum, skipping shapes already
# named, then 631-645 by hand (`tile_names` rebuilt the header's table exactly when this was written)
_TILES_0_TO_35 = ("undefined 8x8 8x16 16x8 8x32 16x16 32x8 8x64 16x32 32x16 64x8 32x32 32x64 64x32 32x128 64x64 "
                  "128x32 64x128 128x64 64x256 128x128 256x64 64x512 128x256 256x128 512x64 64x96 96x64 96x128 "
                  "128x160 160x128 192x128 128x192 128x96 32x256 256x32")


def tile_names() -> dict[int, str]:
    names = _TILES_0_TO_35.split()

    def run(rows: int, step: int, max_cols: int) -> None:
        names.extend(f"{rows}x{cols}" for cols in range(step, max_cols + 1, step) if f"{rows}x{cols}" not in names)
    widest = {64: 768, 72: 640, 80: 576, 96: 512, 104: 448, 128: 384, 152: 320, 192: 256, 256: 192, 384: 128, 768: 64}
    for rows in range(8, 769, 8):  # ids 36-311: cols in steps of 64, up to widest[the first key >= rows]
        run(rows, 64, widest[min(w for w in widest if w >= rows)])
    for rows, max_cols in ((64, 760), (128, 512), (192, 336), (256, 256), (320, 200), (384, 168), (448, 144),
                           (512, 128), (576, 112), (640, 96), (704, 88), (768, 80)):  # ids 312-630: cols in steps of 8
        run(rows, 8, max_cols)
    names += ["256x512", "256x1024", "512x512", "512x1024"]
    names += [f"{rows}x1" for rows in (4, 8, 16, 24, 32, 40, 48, 64, 128, 192, 256)]
    return dict(enumerate(names))


TILE_NAMES = tile_names()
# cublasLtMatmulStages_t (29 and 30 are unused)
STAGES_NAMES = {0: "undefined", **{1 + 6 * i + j: f"{w}x{j + 1}" for i, w in enumerate((16, 32, 64, 128))
                                   for j in range(6)},
                25: "32x10", 26: "8x4", 27: "16x10", 28: "8x5", 31: "8x3", 32: "8xAUTO", 33: "16xAUTO",
                34: "32xAUTO", 35: "64xAUTO", 36: "128xAUTO", 37: "256xAUTO", 38: "768xAUTO"}  # 37, 38: 13.x
STAGES_AUTO_IDS = tuple(range(32, 39))  # CUBLASLT_MATMUL_STAGES_8xAUTO .. 768xAUTO: the library picks the depth
# cublasLtClusterShape_t (1 is unused)
_CLUSTERS = ("auto 1x1x1 2x1x1 4x1x1 1x2x1 2x2x1 4x2x1 1x4x1 2x4x1 4x4x1 8x1x1 1x8x1 8x2x1 2x8x1 16x1x1 1x16x1 "
             "3x1x1 5x1x1 6x1x1 7x1x1 9x1x1 10x1x1 11x1x1 12x1x1 13x1x1 14x1x1 15x1x1 3x2x1 5x2x1 6x2x1 7x2x1 "
             "1x3x1 2x3x1 3x3x1 4x3x1 5x3x1 3x4x1 1x5x1 2x5x1 3x5x1 1x6x1 2x6x1 1x7x1 2x7x1 1x9x1 1x10x1 1x11x1 "
             "1x12x1 1x13x1 1x14x1 1x15x1")
CLUSTER_NAMES = dict(zip([0, *range(2, 52)], _CLUSTERS.split()))
CLUSTER_IDS = {name: value for value, name in CLUSTER_NAMES.items()}


class MatmulAlgo(ctypes.Structure):
    """cublasLtMatmulAlgo_t: opaque, 64 bytes."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """cublasLtMatmulHeuristicResult_t: 96 bytes on a 64-bit host."""
    _fields_ = [("algo", MatmulAlgo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class CublasLtError(RuntimeError):
    """A cuBLASLt call returned a status other than CUBLAS_STATUS_SUCCESS."""

    def __init__(self, call: str, status: int):
        super().__init__(f"{call} failed: CUBLAS_STATUS_{STATUS_NAMES.get(status, status)} ({status})")
        self.call, self.status = call, status


def check(status: int, call: str) -> None:
    if status != CUBLAS_STATUS_SUCCESS:
        raise CublasLtError(call, status)


@dataclass(frozen=True)
class LinearLayout:
    """`F.linear(x [m, k], w [n, k]) -> y [m, n]` (row-major) as cuBLASLt's column-major D = op(A) op(B)."""
    a: tuple[int, int, int]  # (rows, cols, ld) of A: w viewed as k x n
    b: tuple[int, int, int]  # of B: x viewed as k x m
    d: tuple[int, int, int]  # of C and D: y viewed as n x m
    trans_a: int  # cublasOperation_t of A
    trans_b: int


def linear_layout(m: int, n: int, k: int) -> LinearLayout:
    return LinearLayout(a=(k, n, k), b=(k, m, k), d=(n, m, n), trans_a=CUBLAS_OP_T, trans_b=CUBLAS_OP_N)


@dataclass(frozen=True)
class AlgoConfig:
    """What cublasLtMatmulAlgoConfigGetAttribute says of one algorithm (None: the library refused the attribute)."""
    algo_id: int | None
    tile_id: int | None
    splitk_num: int | None
    reduction_scheme: int | None
    cta_swizzling: int | None
    custom_option: int | None
    stages_id: int | None
    inner_shape_id: int | None
    cluster_shape_id: int | None

    @property
    def label(self) -> str:
        """e.g. 'algo66 tile 256x128 stages 64x4 cluster 2x1x1 splitK 1': the columns of the table."""
        def name(table: dict[int, str], value: int | None) -> str:
            return "?" if value is None else table.get(value, f"#{value}")
        text = (f"algo{self.algo_id} tile {name(TILE_NAMES, self.tile_id)} stages {name(STAGES_NAMES, self.stages_id)}"
                f" cluster {name(CLUSTER_NAMES, self.cluster_shape_id)} splitK {self.splitk_num}")
        if self.splitk_num not in (None, 0, 1):
            text += f" ({name(REDUCTION_NAMES, self.reduction_scheme)})"
        return text + (f" swz{self.cta_swizzling}" if self.cta_swizzling else "") + (
            f" opt{self.custom_option}" if self.custom_option else "")


def decode_algo(get: Callable[[int, Any], int | None]) -> AlgoConfig:
    """The AlgoConfig read through `get(attribute value, C type) -> value or None`."""
    return AlgoConfig(**{name: get(value, ctype) for name, value, ctype in ALGO_CONFIG_ATTRS})


def tile_sides(tile_id: int) -> tuple[int, int] | None:
    """(rows, cols) of a cublasLtMatmulTile_t; None for TILE_UNDEFINED and ids the table does not name."""
    name = TILE_NAMES.get(tile_id, "")
    if "x" not in name:
        return None
    rows, cols = name.split("x")
    return int(rows), int(cols)


@dataclass(frozen=True)
class AlgoCaps:
    """What cublasLtMatmulAlgoCapGetAttribute says of one algorithm id (`algo_caps`)."""
    algo_id: int
    tile_ids: tuple[int, ...]  # (): the capability lists none, the algorithm takes TILE_UNDEFINED
    stages_ids: tuple[int, ...]  # (): likewise STAGES_UNDEFINED
    splitk_support: bool
    reduction_scheme_mask: int  # the cublasLtReductionScheme_t bits a split-K may use
    cta_swizzling_support: bool
    custom_option_max: int


@dataclass(frozen=True)
class EnumBounds:
    """How much of each algorithm id's capabilities `enumerate_configs` tries (lt_algos' --enumerate flags)."""
    min_tile: int = 64  # both sides of the output tile at least this (TILE_UNDEFINED and unnamed ids pass)
    max_stages: int = 4  # stages ids per tile, picked by `pick_stages`
    splitk_nums: tuple[int, ...] = (1,)  # SPLITK_NUM values; those > 1 only where SPLITK_SUPPORT
    cluster_shape_ids: tuple[int, ...] = (0, 2, 5, 3)  # auto, 1x1x1, 1x2x1, 2x1x1 (no capability lists them)
    max_custom_option: int = 0  # CUSTOM_OPTION 0 .. min(this, CUSTOM_OPTION_MAX)
    max_checks: int = 10_000  # configurations handed to cublasLtMatmulAlgoCheck per descriptor


@dataclass(frozen=True)
class AlgoChoice:
    """One configuration of one algorithm id: the cublasLtMatmulAlgoConfigAttributes_t values `configure` sets."""
    algo_id: int
    tile_id: int
    stages_id: int
    splitk_num: int
    reduction_scheme: int  # CUBLASLT_REDUCTION_SCHEME_NONE (0) unless splitk_num > 1
    cta_swizzling: int
    custom_option: int
    cluster_shape_id: int

    def settings(self) -> list[tuple[int, int]]:
        """(config attribute, value) for every attribute but the read-only id and the inner shape (left at 0)."""
        return [(attr, getattr(self, name)) for name, attr, _ in ALGO_CONFIG_ATTRS
                if name not in ("algo_id", "inner_shape_id")]


def pick_stages(stages_ids: tuple[int, ...], max_stages: int) -> tuple[int, ...]:
    """Up to `max_stages` of a capability's stages ids: its AUTO ids first (the library sizes the pipeline to the
    tile, so they fit every tile), then, for the room left, the middle id of each of that many equal slices of the
    other ids (ascending 16x1..128x6 with 4 slots: 16x4 32x4 64x4 128x4); (STAGES_UNDEFINED,) for an empty list."""
    if not stages_ids:
        return (0,)
    picked = [s for s in stages_ids if s in STAGES_AUTO_IDS][:max_stages]
    rest = [s for s in stages_ids if s not in STAGES_AUTO_IDS]
    room = min(max_stages - len(picked), len(rest))
    picked += [rest[(2 * i + 1) * len(rest) // (2 * room)] for i in range(room)] if room > 0 else []
    return tuple(picked)


@dataclass(frozen=True)
class EnumPlan:
    choices: list[AlgoChoice]  # the first bounds.max_checks configurations, in the order `enumerate_configs` gives
    num_combinations: int  # all the bounded configurations, before max_checks


def _round_robin(groups: Iterable[Iterator[AlgoChoice]]) -> Iterator[AlgoChoice]:
    alive = list(groups)
    while alive:
        still = []
        for group in alive:
            item = next(group, None)
            if item is not None:
                yield item
                still.append(group)
        alive = still


def _choice(algo_id: int, tile: int, stages: int, cluster: int, swizzle: int, split: tuple[int, int],
            option: int) -> AlgoChoice:
    return AlgoChoice(algo_id, tile, stages, split[0], split[1], swizzle, option, cluster)


def _area(tile_id: int) -> int:
    sides = tile_sides(tile_id)
    return sides[0] * sides[1] if sides else 0


def enumerate_configs(caps: list[AlgoCaps], bounds: EnumBounds) -> EnumPlan:
    """The bounded configurations of every algorithm id. Order: the ids take turns (round robin in `caps` order, so
    max_checks leaves each a share); within one id, tiles with both sides >= min_tile, largest area first (ties in
    the capability's order), then per tile its `pick_stages`, the cluster shapes (bounds' order), CTA swizzling 0
    then 1 (where supported), split-K (bounds' order; > 1 only where supported, with the lowest reduction scheme of
    the mask), custom option 0 up."""
    groups, total = [], 0
    for cap in caps:
        tiles = [t for t in cap.tile_ids if (sides := tile_sides(t)) is None or min(sides) >= bounds.min_tile]
        tiles = sorted(tiles, key=lambda t: -_area(t)) if cap.tile_ids else [0]
        scheme = cap.reduction_scheme_mask & -cap.reduction_scheme_mask  # its lowest set bit
        splits = [(k, 0 if k == 1 else scheme) for k in bounds.splitk_nums
                  if k == 1 or (k > 1 and cap.splitk_support and scheme)]
        axes: list[list[Any]] = [tiles, list(pick_stages(cap.stages_ids, bounds.max_stages)),
                                 list(bounds.cluster_shape_ids), [0, 1] if cap.cta_swizzling_support else [0], splits,
                                 list(range(min(cap.custom_option_max, bounds.max_custom_option) + 1))]
        total += len(tiles) * len(axes[1]) * len(axes[2]) * len(axes[3]) * len(splits) * len(axes[5])
        groups.append(itertools.starmap(functools.partial(_choice, cap.algo_id), itertools.product(*axes)))
    return EnumPlan(list(itertools.islice(_round_robin(groups), bounds.max_checks)), total)


def algo_key(algo: MatmulAlgo) -> bytes:
    return bytes(algo)


def dedupe(results: list[HeuristicResult]) -> list[tuple[int, HeuristicResult]]:
    """(heuristic rank, result) of each distinct algorithm (by its 64 bytes), first occurrence kept."""
    seen: set[bytes] = set()
    out = []
    for rank, r in enumerate(results):
        if algo_key(r.algo) not in seen:
            seen.add(algo_key(r.algo))
            out.append((rank, r))
    return out


def cublaslt_path_from_maps(maps: str) -> str | None:
    """The first mapped file whose name contains libcublasLt.so in /proc/<pid>/maps text."""
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if len(line.split()) >= 6 else ""
        if "libcublasLt.so" in os.path.basename(path):
            return path
    return None


def signatures() -> dict[str, tuple[Any, list[Any]]]:
    """restype and argtypes of every libcublasLt function the binding calls (cublasLt.h's prototypes)."""
    p, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    pp = ctypes.POINTER(p)
    return {
        "cublasLtCreate": (i32, [pp]), "cublasLtDestroy": (i32, [p]),
        "cublasLtGetVersion": (sz, []), "cublasLtGetCudartVersion": (sz, []),
        "cublasLtMatmulDescCreate": (i32, [pp, i32, i32]), "cublasLtMatmulDescDestroy": (i32, [p]),
        "cublasLtMatmulDescSetAttribute": (i32, [p, i32, p, sz]),
        "cublasLtMatrixLayoutCreate": (i32, [pp, i32, u64, u64, i64]), "cublasLtMatrixLayoutDestroy": (i32, [p]),
        "cublasLtMatmulPreferenceCreate": (i32, [pp]), "cublasLtMatmulPreferenceDestroy": (i32, [p]),
        "cublasLtMatmulPreferenceSetAttribute": (i32, [p, i32, p, sz]),
        "cublasLtMatmulAlgoGetHeuristic": (i32, [p, p, p, p, p, p, p, i32, ctypes.POINTER(HeuristicResult),
                                                 ctypes.POINTER(i32)]),
        "cublasLtMatmul": (i32, [p, p, p, p, p, p, p, p, p, p, p, p, ctypes.POINTER(MatmulAlgo), p, sz, p]),
        "cublasLtMatmulAlgoConfigGetAttribute": (i32, [ctypes.POINTER(MatmulAlgo), i32, p, sz, ctypes.POINTER(sz)]),
        "cublasLtMatmulAlgoGetIds": (i32, [p, i32, i32, i32, i32, i32, i32, i32, ctypes.POINTER(i32),
                                           ctypes.POINTER(i32)]),
        "cublasLtMatmulAlgoInit": (i32, [p, i32, i32, i32, i32, i32, i32, i32, ctypes.POINTER(MatmulAlgo)]),
        "cublasLtMatmulAlgoCapGetAttribute": (i32, [ctypes.POINTER(MatmulAlgo), i32, p, sz, ctypes.POINTER(sz)]),
        "cublasLtMatmulAlgoConfigSetAttribute": (i32, [ctypes.POINTER(MatmulAlgo), i32, p, sz]),
        "cublasLtMatmulAlgoCheck": (i32, [p, p, p, p, p, p, ctypes.POINTER(MatmulAlgo),
                                          ctypes.POINTER(HeuristicResult)]),
    }


def load_cublaslt() -> tuple[ctypes.CDLL, str]:
    """(the libcublasLt that torch loaded, its path); torch must have run a bf16 GEMM on the GPU already."""
    with open("/proc/self/maps") as f:
        path = cublaslt_path_from_maps(f.read()) or ctypes.util.find_library("cublasLt")
    if path is None:
        raise RuntimeError("no libcublasLt: not mapped in this process after a GPU F.linear, and "
                           "ctypes.util.find_library('cublasLt') found none; install torch's CUDA build")
    lib = ctypes.CDLL(path)
    for name, (restype, argtypes) in signatures().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, path


GEMM_TYPES = (CUBLAS_COMPUTE_32F, CUDA_R_32F, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16BF)  # compute, scale, A-D


@dataclass
class Enumeration:
    """What `LinearGemm.enumerate` found: the valid configurations and how many were tried."""
    results: list[HeuristicResult]  # accepted by cublasLtMatmulAlgoCheck within the workspace, in check order
    num_algo_ids: int  # algorithm ids initialized and described
    num_combinations: int  # their bounded configurations (before max_checks)
    num_checked: int
    errors: list[str]  # an algorithm id that cublasLtMatmulAlgoInit or a capability query refused
    check_statuses: dict[str, int] = field(default_factory=dict)  # SUCCESS / over_workspace / NOT_SUPPORTED ...: count


class LinearGemm:
    """One `F.linear` shape (m, n, k) in bf16 as cuBLASLt descriptors, with or without an SM-count target.
    Owns its descriptors: close() frees them."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, m: int, n: int, k: int, sm_target: int = 0):
        self.lib, self.handle, self.sm_target = lib, handle, sm_target
        self.desc = ctypes.c_void_p()
        self.layouts = [ctypes.c_void_p() for _ in range(3)]  # A, B, C = D
        self.pref = ctypes.c_void_p()
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        lay = linear_layout(m, n, k)
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
              "cublasLtMatmulDescCreate")
        for attr, value in ((CUBLASLT_MATMUL_DESC_TRANSA, lay.trans_a), (CUBLASLT_MATMUL_DESC_TRANSB, lay.trans_b)) + (
                ((CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET, sm_target),) if sm_target else ()):
            v = ctypes.c_int32(value)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), ctypes.sizeof(v)),
                  f"cublasLtMatmulDescSetAttribute({attr})")
        for out, (rows, cols, ld) in zip(self.layouts, (lay.a, lay.b, lay.d)):
            check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), CUDA_R_16BF, rows, cols, ld),
                  f"cublasLtMatrixLayoutCreate({rows}x{cols}, ld {ld})")
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")

    def heuristics(self, max_workspace_bytes: int, count: int) -> list[HeuristicResult]:
        """Up to `count` algorithms, best estimated first, each needing at most `max_workspace_bytes`."""
        ws = ctypes.c_uint64(max_workspace_bytes)
        check(self.lib.cublasLtMatmulPreferenceSetAttribute(self.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                            ctypes.byref(ws), ctypes.sizeof(ws)),
              "cublasLtMatmulPreferenceSetAttribute(MAX_WORKSPACE_BYTES)")
        results, returned = (HeuristicResult * count)(), ctypes.c_int(0)
        a, b, d = self.layouts
        check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, d, d, self.pref, count, results,
                                                      ctypes.byref(returned)), "cublasLtMatmulAlgoGetHeuristic")
        return [results[i] for i in range(returned.value) if results[i].state == CUBLAS_STATUS_SUCCESS]

    def algo_ids(self, max_ids: int = 1024) -> list[int]:
        """cublasLtMatmulAlgoGetIds for this GEMM's types (compute 32F, scale 32F, A/B/C/D bf16)."""
        ids, returned = (ctypes.c_int * max_ids)(), ctypes.c_int(0)
        check(self.lib.cublasLtMatmulAlgoGetIds(self.handle, *GEMM_TYPES, max_ids, ids, ctypes.byref(returned)),
              "cublasLtMatmulAlgoGetIds")
        return list(ids[:returned.value])

    def init_algo(self, algo_id: int) -> MatmulAlgo:
        algo = MatmulAlgo()
        check(self.lib.cublasLtMatmulAlgoInit(self.handle, *GEMM_TYPES, algo_id, ctypes.byref(algo)),
              f"cublasLtMatmulAlgoInit({algo_id})")
        return algo

    def check_algo(self, algo: MatmulAlgo) -> tuple[int, HeuristicResult]:
        """(cublasLtMatmulAlgoCheck's status, its result: workspace size and waves count, with `algo` copied in)."""
        result, (a, b, d) = HeuristicResult(), self.layouts
        status = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, d, d, ctypes.byref(algo),
                                                  ctypes.byref(result))
        result.algo = algo  # the check never writes it
        return status, result

    def enumerate(self, bounds: EnumBounds, max_workspace_bytes: int) -> Enumeration:
        """Every algorithm id's bounded configurations (`enumerate_configs`) that cublasLtMatmulAlgoCheck accepts for
        this descriptor and that need at most `max_workspace_bytes`, in the plan's order."""
        caps, errors, inits = [], [], {}
        for algo_id in self.algo_ids():
            try:
                inits[algo_id] = self.init_algo(algo_id)
                caps.append(algo_caps(self.lib, inits[algo_id], algo_id))
            except CublasLtError as e:
                errors.append(str(e))
        plan = enumerate_configs(caps, bounds)
        out = Enumeration(results=[], num_algo_ids=len(caps), num_combinations=plan.num_combinations,
                          num_checked=len(plan.choices), errors=errors)
        for choice in plan.choices:
            try:
                status, result = self.check_algo(configure(self.lib, inits[choice.algo_id], choice))
                name = STATUS_NAMES.get(status, str(status))
            except CublasLtError as e:  # a value ConfigSetAttribute refused
                name = f"set_{STATUS_NAMES.get(e.status, e.status)}"
            if status == CUBLAS_STATUS_SUCCESS and result.workspaceSize > max_workspace_bytes:
                name = "over_workspace"
            out.check_statuses[name] = out.check_statuses.get(name, 0) + 1
            if name == "SUCCESS":
                out.results.append(result)
        return out

    def run(self, algo: MatmulAlgo, w_ptr: int, x_ptr: int, y_ptr: int, ws_ptr: int, ws_bytes: int,
            stream: int) -> int:
        """Launch y = x w^T with `algo` on `stream` (a cudaStream_t as int); returns the cublasStatus_t."""
        a, b, d = self.layouts
        return self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), w_ptr, a, x_ptr, b,
                                       ctypes.byref(self.beta), y_ptr, d, y_ptr, d, ctypes.byref(algo), ws_ptr,
                                       ws_bytes, stream)

    def close(self) -> None:
        self.lib.cublasLtMatmulPreferenceDestroy(self.pref)
        for layout in self.layouts:
            self.lib.cublasLtMatrixLayoutDestroy(layout)
        self.lib.cublasLtMatmulDescDestroy(self.desc)


def describe(lib: ctypes.CDLL, algo: MatmulAlgo) -> AlgoConfig:
    def get(attr: int, ctype: Any) -> int | None:
        value, written = ctype(), ctypes.c_size_t(0)
        status = lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                          ctypes.sizeof(value), ctypes.byref(written))
        return int(value.value) if status == CUBLAS_STATUS_SUCCESS else None
    return decode_algo(get)


def algo_caps(lib: ctypes.CDLL, algo: MatmulAlgo, algo_id: int) -> AlgoCaps:
    """The capabilities of an initialized algorithm (cublasLtMatmulAlgoCapGetAttribute); raises CublasLtError."""
    def scalar(attr: int, ctype: Any) -> int:
        value, written = ctype(), ctypes.c_size_t(0)
        check(lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                    ctypes.sizeof(value), ctypes.byref(written)),
              f"cublasLtMatmulAlgoCapGetAttribute({attr})")
        return int(value.value)

    def ids(attr: int) -> tuple[int, ...]:
        needed = ctypes.c_size_t(0)  # sizeInBytes 0: the bytes the whole array needs
        check(lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(needed)),
              f"cublasLtMatmulAlgoCapGetAttribute({attr}, size)")
        count = needed.value // ctypes.sizeof(ctypes.c_uint32)
        if count == 0:
            return ()
        values, written = (ctypes.c_uint32 * count)(), ctypes.c_size_t(0)
        check(lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, ctypes.sizeof(values),
                                                    ctypes.byref(written)), f"cublasLtMatmulAlgoCapGetAttribute({attr})")
        return tuple(values[:written.value // ctypes.sizeof(ctypes.c_uint32)])

    return AlgoCaps(algo_id=algo_id, tile_ids=ids(CUBLASLT_ALGO_CAP_TILE_IDS),
                    stages_ids=ids(CUBLASLT_ALGO_CAP_STAGES_IDS),
                    splitk_support=bool(scalar(CUBLASLT_ALGO_CAP_SPLITK_SUPPORT, ctypes.c_int32)),
                    reduction_scheme_mask=scalar(CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK, ctypes.c_uint32),
                    cta_swizzling_support=bool(scalar(CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT, ctypes.c_uint32)),
                    custom_option_max=scalar(CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, ctypes.c_int32))


def configure(lib: ctypes.CDLL, algo: MatmulAlgo, choice: AlgoChoice) -> MatmulAlgo:
    """A copy of `algo` (cublasLtMatmulAlgoInit of choice.algo_id) with choice's settings; raises CublasLtError."""
    out = MatmulAlgo.from_buffer_copy(bytes(algo))
    for attr, value in choice.settings():
        v = ALGO_CONFIG_TYPES[attr](value)
        check(lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(out), attr, ctypes.byref(v), ctypes.sizeof(v)),
              f"cublasLtMatmulAlgoConfigSetAttribute({attr} = {value})")
    return out
