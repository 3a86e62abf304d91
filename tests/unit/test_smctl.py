"""native/libsmctl on a machine without a GPU: it builds with gcc, loads through ctypes, reports "no driver"
cleanly, rejects bad arguments with typed errors, and (against a fake libcuda.so.1 compiled here) makes
ladders with the splits and streams the driver grants, maps driver failures to CudaError/NotSupportedError,
and frees every context and stream it made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bullet_ray.gpu import smctl

ROOT = Path(__file__).resolve().parents[2]
needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


def _has_driver() -> bool:
    return smctl.capability_report(0).has_gpu


@needs_gcc
def test_library_builds_with_make_and_loads():
    subprocess.run(["make", "-s", "-C", str(ROOT / "native")], check=True)
    assert (ROOT / "native" / "libsmctl.so").exists()
    assert smctl.version() == 200


@needs_gcc
def test_library_builds_on_demand_into_a_cache_folder(tmp_path):
    so = smctl.build(tmp_path / "native" / "libsmctl.so")
    assert so.exists()
    import ctypes

    lib = ctypes.CDLL(str(so))
    lib.smctl_version.restype = ctypes.c_int
    assert lib.smctl_version() == 200


def test_every_function_declares_argtypes_and_restype():
    lib = smctl.lib()
    for name in ("smctl_version", "smctl_capabilities", "smctl_ladder_create", "smctl_ladder_size",
                 "smctl_ladder_entry", "smctl_ladder_destroy", "smctl_last_cuda_error", "smctl_cuda_error_name",
                 "smctl_last_error", "smctl_strerror"):
        fn = getattr(lib, name)
        assert fn.argtypes is not None, name
    assert lib.smctl_strerror(-3) == b"invalid argument"
    assert lib.smctl_strerror(-99) == b"unknown smctl error"


@pytest.mark.skipif(_has_driver(), reason="this machine has a CUDA driver")
def test_no_driver_is_reported_cleanly():
    with pytest.raises(smctl.NoDriverError) as err:
        smctl.capabilities(0)
    assert err.value.code == smctl.SMCTL_ENODRIVER
    assert "driver" in str(err.value).lower()
    report = smctl.capability_report(0)
    assert report.sm_count == 0 and not report.green_ctx_supported and "driver" in report.reason.lower()
    with pytest.raises(smctl.NoDriverError):
        smctl.NativeLadder(0, [16], smctl.SIDE_DECODE)


@pytest.mark.parametrize("counts,mask,match", [
    ([16], 7, "side_mask 7"),
    ([16], 0, "side_mask 0"),
    ([], smctl.SIDE_DECODE, "at least one"),
    ([16, 0], smctl.SIDE_DECODE, "count 0 .entry 1"),
    ([-8], smctl.SIDE_BOTH, "count -8"),
])
def test_bad_arguments_are_rejected_before_touching_the_driver(counts, mask, match):
    with pytest.raises(smctl.InvalidArgumentError, match=match) as err:
        smctl.NativeLadder(0, counts, mask)
    assert isinstance(err.value, ValueError)


FAKE_DRIVER = r"""
/* A stand-in libcuda.so.1: 132 SMs, groups rounded up to 8 SMs; env FAKE_CUDA_* selects failures. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
typedef struct { int type; unsigned char pad[92]; unsigned int sm[4]; unsigned char rest[24]; void* next; } Res;
static int live_ctx, live_streams, inited;
static int env(const char* k) { return getenv(k) != NULL; }
static int cuInit(unsigned f) { (void)f; if (env("FAKE_CUDA_INIT_FAIL")) return 100; inited = 1; return 0; }
static int cuDriverGetVersion(int* v) { *v = 13000; return 0; }
static int cuDeviceGetCount(int* n) { *n = 1; return 0; }
static int cuDeviceGet(int* d, int i) { *d = i; return 0; }
static int cuDeviceGetAttribute(int* v, int a, int d) { (void)d; *v = a == 16 ? 132 : 0; return 0; }
static void* current;
static int cuCtxGetCurrent(void** c) { *c = current; return 0; }
static int cuCtxSetCurrent(void* c) { current = c; return 0; }
static int cuDevicePrimaryCtxRetain(void** c, int d) { (void)d; *c = (void*)0x1000; return 0; }
static int cuDeviceGetDevResource(int d, Res* r, int t) {
    (void)d; memset(r, 0, sizeof *r); r->type = t; r->sm[0] = 132; r->sm[1] = 8; r->sm[2] = 8; return 0; }
static int cuDevSmResourceSplitByCount(Res* g, unsigned* n, const Res* in, Res* rest, unsigned f, unsigned k) {
    (void)f; unsigned want = (k + 7) / 8 * 8; if (want > in->sm[0]) return 1; /* CUDA_ERROR_INVALID_VALUE */
    *n = 1; *g = *in; g->sm[0] = want; *rest = *in; rest->sm[0] = in->sm[0] - want; return 0; }
static int cuDevResourceGenerateDesc(void** d, Res* r, unsigned n) { (void)n; *d = (void*)(uintptr_t)r->sm[0]; return 0; }
static int cuGreenCtxCreate(void** c, void* d, int dev, unsigned f) {
    (void)d; (void)dev; (void)f; if (env("FAKE_CUDA_CREATE_FAIL") && live_ctx >= 1) return 2;
    *c = malloc(1); live_ctx++; return 0; }
static int cuGreenCtxStreamCreate(void** s, void* c, unsigned f, int p) {
    (void)c; (void)f; (void)p; *s = malloc(1); live_streams++; return 0; }
static int cuGreenCtxDestroy(void* c) { free(c); live_ctx--; return 0; }
static int cuStreamDestroy(void* s) { free(s); live_streams--; return 0; }
static int cuGetErrorName(int r, const char** s) {
    *s = r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : r == 1 ? "CUDA_ERROR_INVALID_VALUE" : r == 100 ? "CUDA_ERROR_NO_DEVICE" : "E";
    return 0; }
static int cuGetErrorString(int r, const char** s) { (void)r; *s = "fake"; return 0; }
int fake_live_objects(void) { return live_ctx + live_streams; }
#define E(n) if (!strcmp(sym, #n)) { *pfn = (void*)n; return 0; }
int cuGetProcAddress_v2(const char* sym, void** pfn, int ver, unsigned long long flags, int* status) {
    (void)flags; (void)status; *pfn = NULL; if (ver < 12040) return 500;
    if (!strcmp(sym, "cuGreenCtxStreamCreate") && ver < 12050) return 500; /* as the real driver: new in 12.5 */
    E(cuInit) E(cuDriverGetVersion) E(cuDeviceGetCount) E(cuDeviceGet) E(cuDeviceGetAttribute) E(cuCtxGetCurrent)
    E(cuCtxSetCurrent) E(cuDevicePrimaryCtxRetain) E(cuStreamDestroy) E(cuGetErrorName) E(cuGetErrorString)
    if (env("FAKE_CUDA_NO_GREEN")) return 500;
    E(cuDeviceGetDevResource) E(cuDevSmResourceSplitByCount) E(cuDevResourceGenerateDesc) E(cuGreenCtxCreate)
    E(cuGreenCtxStreamCreate) E(cuGreenCtxDestroy)
    return 500; /* CUDA_ERROR_NOT_FOUND */
}
"""

CHILD = textwrap.dedent("""
    import ctypes, json, sys
    from bullet_ray.gpu import smctl
    out = {}
    try:
        out["caps"] = smctl.capabilities(0).as_dict()
    except smctl.SmctlError as e:
        out["caps_error"] = [type(e).__name__, str(e)]
    for name, counts, mask in [("both", [16, 66, 120], 3), ("decode", [16, 64], 1), ("prefill", [16], 2),
                               ("too_many", [132], 1), ("round_up_all", [130], 3)]:
        try:
            with smctl.NativeLadder(0, counts, mask) as ladder:
                out[name] = [e.__dict__ for e in ladder.entries]
        except smctl.SmctlError as e:
            out[name] = [type(e).__name__, str(e), getattr(e, "cuda_error", None), getattr(e, "cuda_error_name", None)]
    try:
        out["live"] = ctypes.CDLL("libcuda.so.1").fake_live_objects()
    except OSError:
        out["live"] = None
    print(json.dumps(out))
""")


def _run_with_fake_driver(tmp_path: Path, **flags: str) -> dict:
    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_DRIVER)
    so = tmp_path / "libcuda.so.1"
    if not so.exists():
        subprocess.run(["gcc", "-O1", "-fPIC", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(so), str(src)],
                       check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": str(tmp_path), "PYTHONPATH": str(ROOT), **flags}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_gcc
def test_ladder_against_a_fake_driver(tmp_path):
    out = _run_with_fake_driver(tmp_path)
    assert out["caps"] == {"driver_version": 13000, "sm_count": 132, "green_ctx_supported": True,
                           "min_partition_sms": 8, "partition_alignment": 8, "reason": ""}
    both = out["both"]
    assert [(e["decode_sms"], e["prefill_sms"]) for e in both] == [(16, 116), (72, 60), (120, 12)]  # 66 -> 72
    assert all(e["decode_stream"] and e["prefill_stream"] for e in both)
    assert len({e["decode_stream"] for e in both} | {e["prefill_stream"] for e in both}) == 6
    assert all(e["decode_stream"] and not e["prefill_stream"] for e in out["decode"])  # one side per process
    assert all(e["prefill_stream"] and not e["decode_stream"] for e in out["prefill"])
    assert out["too_many"][0] == "InvalidArgumentError" and "outside [1, 131]" in out["too_many"][1]
    # 130 rounds up to 136 > 132 SMs: the driver refuses, reported with the CUresult and its name
    assert out["round_up_all"][0] == "CudaError" and out["round_up_all"][2:] == [1, "CUDA_ERROR_INVALID_VALUE"]
    assert out["live"] == 0  # every context and stream destroyed


@needs_gcc
def test_fake_driver_failures_map_to_typed_errors(tmp_path):
    out = _run_with_fake_driver(tmp_path, FAKE_CUDA_NO_GREEN="1")
    assert out["caps"]["green_ctx_supported"] is False and "green contexts" in out["caps"]["reason"]
    assert out["both"][0] == "NotSupportedError"
    out = _run_with_fake_driver(tmp_path, FAKE_CUDA_INIT_FAIL="1")
    assert out["caps_error"][0] == "NoDriverError" and "CUDA_ERROR_NO_DEVICE" in out["caps_error"][1]
    out = _run_with_fake_driver(tmp_path, FAKE_CUDA_CREATE_FAIL="1")
    assert out["both"][0] == "CudaError" and out["both"][2:] == [2, "CUDA_ERROR_OUT_OF_MEMORY"]
    assert "cuGreenCtxCreate" in out["both"][1]
    assert out["live"] == 0  # a failed create leaves nothing behind


@pytest.mark.skipif(_has_driver(), reason="this machine has a CUDA driver")
def test_selftest_without_gpu_reports_and_exits_zero(tmp_path, capsys):
    from bullet_ray.gpu.selftest import main

    assert main(["--out", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "no GPU: nothing to measure" in out and "no CUDA driver" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["capabilities"]["sm_count"] == 0 and "driver" in report["capabilities"]["reason"]
    assert "choices' cache" in out and "cublaslt" not in report["prefill_gemm"]  # no GPU: the library is not opened
    assert set(report["prefill_gemm"]) == {"cache", "cached_choices"}
