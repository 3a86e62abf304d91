"""A ctypes binding to the libcublasLt that torch loaded: just what `benchmarks/gpu/lt_algos.py` needs to ask
cuBLASLt's heuristic for every algorithm of an `F.linear` GEMM (or enumerate them: `LinearGemm.enumerate`, with the
bounded configurations of `bullet_ray/gpu/cublaslt_ids.py`), describe each one and launch it on a stream.

The GEMM is `F.linear(x, w)`: x [M=T, K], w [N, K], y [M, N], bf16, row-major. In cuBLASLt's column-major terms
D (N x M, ld N) = op(A) op(B) with A = w as K x N (ld K, TRANSA = T) and B = x as K x M (ld K, TRANSB = N);
compute CUBLAS_COMPUTE_32F, scale CUDA_R_32F, alpha 1, beta 0, C = D (`linear_layout`, `LinearGemm`).
Importing it needs neither torch nor CUDA; `load_cublaslt` needs torch to have run a GEMM on the GPU first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bullet_ray.gpu.cublaslt_ids import (
    ALGO_CONFIG_ATTRS,
    CLUSTER_IDS,
    CLUSTER_NAMES,
    REDUCTION_NAMES,
    STAGES_NAMES,
    TILE_NAMES,
    AlgoCaps,
    AlgoChoice,
    EnumBounds,
    enumerate_configs,
)

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
# libcublasLt 13.10 on a CPU: ConfigSetAttribute takes exactly these sizes (the id none: read-only), and
# ConfigGetAttribute reads back what `configure` set
ALGO_CONFIG_TYPES = {value: ctype for _, value, ctype in ALGO_CONFIG_ATTRS}
CLUSTER_SHAPE_ATTR = next(value for name, value, _ in ALGO_CONFIG_ATTRS if name == "cluster_shape_id")
# cublasLtMatmulAlgoCapAttributes_t (cuBLAS 13.10's cublasLt.h) read by `algo_caps`, with the C type each holds; the
# header has no capability for cluster shapes (NVIDIA's LtMatmulCustomFind sample tries every cublasLtClusterShape_t)
CUBLASLT_ALGO_CAP_SPLITK_SUPPORT = 0  # int32_t, 0: no split-K
CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK = 1  # uint32_t, a mask of cublasLtReductionScheme_t
CUBLASLT_ALGO_CAP_CTA_SWIZZLING_SUPPORT = 2  # uint32_t, 0: none, 1: CTA_SWIZZLING 1 allowed
CUBLASLT_ALGO_CAP_TILE_IDS = 6  # uint32_t array (size asked with sizeInBytes 0)
CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX = 7  # int32_t, CUSTOM_OPTION takes 0..this
CUBLASLT_ALGO_CAP_STAGES_IDS = 13  # uint32_t array
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
    return with_settings(lib, algo, choice.settings())


def with_settings(lib: ctypes.CDLL, algo: MatmulAlgo, settings: list[tuple[int, int]]) -> MatmulAlgo:
    """A copy of `algo` with each (config attribute, value) set, e.g. a heuristic's algorithm with another cluster
    shape (CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID); raises CublasLtError where the library refuses a value."""
    out = MatmulAlgo.from_buffer_copy(bytes(algo))
    for attr, value in settings:
        v = ALGO_CONFIG_TYPES[attr](value)
        check(lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(out), attr, ctypes.byref(v), ctypes.sizeof(v)),
              f"cublasLtMatmulAlgoConfigSetAttribute({attr} = {value})")
    return out


def with_cluster(lib: ctypes.CDLL, raw: bytes, cluster: str) -> bytes | None:
    """The algorithm `raw` (a cublasLtMatmulAlgo_t's 64 bytes) with cluster shape `cluster` (a CLUSTER_IDS name), as
    64 bytes; None where the library refuses the value (cublasLtMatmulAlgoCheck still judges the result)."""
    try:
        return bytes(with_settings(lib, MatmulAlgo.from_buffer_copy(raw), [(CLUSTER_SHAPE_ATTR, CLUSTER_IDS[cluster])]))
    except CublasLtError:
        return None
