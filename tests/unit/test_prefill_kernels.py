"""benchmarks.gpu.prefill_kernels' trace reading (the GPU part runs on the device; results under benchmarks/results/)."""

from benchmarks.gpu.prefill_kernels import kernel_class, projections, summarize_trace
from bullet_ray.models.loader import resolve_source


def test_kernel_classes():
    assert kernel_class("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    assert kernel_class("void flashinfer::PrefillWithKVCacheKernel<...>") == "attention"
    # flashinfer's Hopper kernels carry cutlass types in their template arguments
    assert kernel_class("void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<"
                        "cutlass::bfloat16_t>>") == "attention"
    assert kernel_class("void flashinfer::norm::FusedAddRMSNormKernel<8u>") == "norm"
    assert kernel_class("void flashinfer::activation::act_and_mul_kernel<>") == "activation"
    assert kernel_class("void flashinfer::BatchQKApplyRotaryPosIdsCosSinCache<>") == "rotary"
    assert kernel_class("void at::native::elementwise_kernel<128, 4>") == "other"


def test_summary_counts_overlap_once_and_splits_by_class():
    # two steps: a GEMM 0-10 us, attention 5-15 (overlapping it), a norm 20-25; busy 20 of a 25 us window
    events = [{"cat": "kernel", "name": "nvjet_x", "ts": 0, "dur": 10, "args": {"grid": [2, 66, 1]}},
              {"cat": "kernel", "name": "flashinfer::PrefillWithKVCacheKernel", "ts": 5, "dur": 10},
              {"cat": "kernel", "name": "RMSNormKernel", "ts": 20, "dur": 5},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100}]
    s = summarize_trace({"traceEvents": events}, steps=2)
    assert s["kernels_per_step"] == 1.5
    assert s["by_class_ms"] == {"gemm": 0.005, "attention": 0.005, "norm": 0.0025}
    assert s["busy_share"] == 0.8
    assert s["top"][0]["name"] == "nvjet_x" and s["top"][0]["grid"] == [2, 66, 1]
    assert summarize_trace({"traceEvents": []}, 1) == {"kernels_found": 0}


def test_projections_follow_the_fused_weights():
    cfg = resolve_source("dummy:llama-3.1-8b").config
    assert projections(cfg) == {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672),
                                "down": (14336, 4096)}
