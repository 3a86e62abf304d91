"""benchmarks.gpu.kernel_compare: kernel-name categories, trace summaries, the table, a CPU smoke run."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from benchmarks.gpu.kernel_compare import (
    CATEGORIES,
    categorize,
    main,
    markdown_table,
    matched_steps_table,
    our_step_starts,
    per_step_device_ms,
    prompt_cost_table,
    prompt_token_cost,
    read_step_log,
    step_annotations,
    step_costs,
    step_token_summary,
    summarize_trace,
)

# Real kernel names: ours from benchmarks/results/mixed_step_profile_h100/hybrid-trace.json.gz (H100, torch
# 2.11, flashinfer 0.7.2); vLLM's from the symbols of the vLLM 0.24.0 wheel (_vllm_fa3_C, _C_stable_libtorch);
# cuBLAS / Triton / torch from their usual spellings (inductor names its kernels after the fused ops).
NAMES = {
    # gemm
    "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT": "gemm",
    "nvjet_tst_192x192_64x4_2x1_v_bz_coopA_NNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_"
    "kernel__5x_cublas": "gemm",
    "cutlass3x_sm90_tensorop_gemm_bf16_bf16_f32_bf16_bf16_128x128x64_1x1x1_0_tnn_align8_warpspecialized_"
    "cooperative_epi_tma": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, "
    "false>(cublasLt::cublasSplitKParams<float>, float const*, __nv_bfloat16 const*, __nv_bfloat16*)": "gemm",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 2, 2, false, false, "
    "cublasGemvParamsEx<int, cublasGemvTensorStridedBatched<__nv_bfloat16 const>>, float>(float, float)": "gemm",
    "triton_tem_fused_mm_3": "gemm",
    # attention: flashinfer (ours)
    "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 1u, 8u, 16u, 4u, 2u, "
    "flashinfer::DefaultAttention<false, false, false, false>, Params>(Params)": "attention_decode",
    "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16, __nv_bfloat16, "
    "int>(__nv_bfloat16*, float*, int*, __nv_bfloat16*, float*, unsigned int, unsigned int*, unsigned int)":
        "attention_decode",
    "void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<PagedParams::AdditionalParams, "
    "flashinfer::AttentionKernelTraits<false, 128, 128, 128, 96, 2, cutlass::bfloat16_t, cutlass::bfloat16_t, "
    "cutlass::bfloat16_t, int>>>": "attention_prefill",
    "void flashinfer::BatchPrefillWithPagedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)1, 128u, "
    "1u, 4u, 8u, 8u, 1u, 4u, (flashinfer::PosEncodingMode)0, __nv_bfloat16, __nv_bfloat16, __nv_bfloat16, float, "
    "int, flashinfer::DefaultAttention<false, false, false, false>>, Params>(Params)": "attention_prefill",
    "void flashinfer::BatchPrefillWithRaggedKVCacheKernel<flashinfer::KernelTraits<(flashinfer::MaskMode)1, 128u, "
    "4u, 1u, 8u, 8u, 1u, 4u>, Params>(Params)": "attention_prefill",
    "void flashinfer::PersistentKernel<flashinfer::BlockBatchPagedAttentionPersistent<128, 128>>(Params)":
        "attention_prefill",
    "void flashinfer::MergeStatesKernel<8u, 16u, 8u, 4u, __nv_bfloat16, __nv_bfloat16>(__nv_bfloat16*, float*, "
    "__nv_bfloat16*, float*, unsigned int, unsigned int)": "attention_decode",
    # attention: FlashAttention (vLLM)
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
    "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<128>, cute::C<128> >, "
    "128, cutlass::bfloat16_t, float, cutlass::arch::Sm90, false, true, false, true, false, false, false, true, true, "
    "true, false, false, cutlass::bfloat16_t, 1>, flash::CollectiveEpilogueFwd<cute::tuple<cute::C<128>, "
    "cute::C<128>, cute::C<128> >, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cutlass::bfloat16_t, "
    "cutlass::arch::Sm90, 256, true, true, false, false, 1>, flash::VarlenDynamicPersistentTileScheduler<128, 128, "
    "256, 128, false, true, true, true, false, true> > > >(...)": "attention_prefill",
    "void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<16>, cute::C<64> >, 4, 256, 1, "
    "false, false, cutlass::bfloat16_t, float, cutlass::arch::Sm90> >(flash::FlashAttnFwdCombine<cute::tuple<"
    "cute::C<16>, cute::C<64> >, 4, 256, 1, false, false, cutlass::bfloat16_t, float, cutlass::arch::Sm90>::Params)":
        "attention_decode",
    "void flash::prepare_varlen_num_blocks_kernel(int, int, int, int const*, int const*, int const*, int const*, "
    "int const*, int const*, int, int, int, int, int, cutlass::FastDivmod, cutlass::FastDivmod, int*, int*, bool)":
        "attention_prefill",
    "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4, false, false, cutlass::bfloat16_t>, "
    "false, false, false, false, true, true, false, false>(Flash_fwd_params)": "attention_decode",
    "void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, 4, 1, true>(Flash_fwd_params)":
        "attention_decode",
    "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, true, false, "
    "false, false, true, true, false>(Flash_fwd_params)": "attention_prefill",
    "void vllm::merge_attn_states_kernel<__nv_bfloat16, __nv_bfloat16, 128u, false>(__nv_bfloat16*, float*, "
    "__nv_bfloat16 const*, float const*, __nv_bfloat16 const*, float const*, unsigned int, unsigned int, unsigned "
    "int, unsigned int, unsigned int, unsigned int, float const*)": "attention_decode",
    # K/V writes
    "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>("
    "__nv_bfloat16 const*, __nv_bfloat16 const*, __nv_bfloat16*, __nv_bfloat16*, long const*, long, long, long, "
    "long, long, int, int, int, float const*, float const*, int)": "kv_write",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_kernel_"
    "impl<at::native::OpaqueType<2> >(at::TensorIterator&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, "
    "char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)": "kv_write",
    "void flashinfer::AppendPagedKVCacheKernel<8u, 16u, __nv_bfloat16, int>(flashinfer::paged_kv_t<__nv_bfloat16, "
    "int>, __nv_bfloat16*, __nv_bfloat16*, int*, int*, unsigned int, unsigned long, unsigned long, unsigned long, "
    "unsigned long)": "kv_write",
    # norms, activations, rotary: CUDA and Triton
    "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, "
    "__nv_bfloat16*, unsigned int, unsigned int, unsigned int, float, float)": "norm",
    "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, "
    "unsigned int, unsigned int, unsigned int, float, float)": "norm",
    "std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type vllm::fused_add_rms_norm_"
    "kernel<c10::BFloat16, 8, false>(c10::BFloat16*, long, c10::BFloat16*, c10::BFloat16 const*, float, int, int)":
        "norm",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_per_fused__to_copy_mean_mul_pow_rsqrt_1": "norm",
    "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &(silu(float const&)), 8u>(__nv_bfloat16*, "
    "__nv_bfloat16 const*, int)": "activation",
    "void vllm::act_and_mul_kernel<c10::BFloat16, __nv_bfloat162, &(c10::BFloat16 vllm::silu_kernel<c10::BFloat16>"
    "(c10::BFloat16 const&, float)), &(__nv_bfloat162 vllm::packed_silu_kernel<__nv_bfloat162>(__nv_bfloat162 "
    "const&, float)), false, false, false>(c10::BFloat16*, c10::BFloat16 const*, int)": "activation",
    "triton_poi_fused_mul_silu_slice_1": "activation",
    "void flashinfer::BatchQKApplyRotaryPosIdsCosSinCacheHeadParallelismKernel<false, 128u, 8u, 16u, __nv_bfloat16, "
    "long>(__nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, __nv_bfloat16*, float*, long*, unsigned int)": "rotary",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, true>(long const*, c10::BFloat16*, c10::BFloat16*, "
    "c10::BFloat16 const*, int, long, long, long, int, int, int)": "rotary",
    "triton_poi_fused_add_cat_index_select_mul_split_sub_2": "rotary",
    "triton_poi_fused_add_3": "triton",
    "triton_poi_fused__to_copy_clone_slice_4": "triton",
    # sampling
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)": "sampling",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "sampling",
    "void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u, (cub::BlockScanAlgorithm)2, "
    "(cub::BlockReduceAlgorithm)2, 4u, true, float, int>(float*, int*, int*, float*, int, float*, float, unsigned "
    "int, unsigned long, unsigned long)": "sampling",
    "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<at_cuda_detail::cub::DeviceRadixSortPolicy<float, long, "
    "unsigned int>::Policy900, true, float, long, unsigned int, int, int>(int*, int*, unsigned int*, int const*, "
    "float*, float const*, long*, long const*, int, int, int)": "sampling",
    # copies and data movement
    "Memcpy HtoD (Pinned -> Device)": "copy",
    "Memset (Device)": "copy",
    "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_"
    "cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda("
    "c10::BFloat16)#1}>(at::TensorIteratorBase&, at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1} const&)::"
    "{lambda(int)#1}>(int, at::native::gpu_kernel_impl_nocast)": "copy",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1ul> >(int, "
    "at::native::FillFunctor<float>, std::array<char*, 1ul>)": "copy",
    "void at::native::(anonymous namespace)::CatArrayBatchedCopy_alignedK_contig<at::native::(anonymous namespace)::"
    "OpaqueType<8u>, unsigned int, 2, 128, 1, 16>(at::native::(anonymous namespace)::OpaqueType<8u>*, "
    "at::native::(anonymous namespace)::CatArrInputTensorMetadata<at::native::(anonymous namespace)::OpaqueType<8u>, "
    "unsigned int, 128, 1>, at::native::(anonymous namespace)::TensorSizeStride<unsigned int, 4u>, int, unsigned "
    "int)": "copy",
    "void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)":
        "copy",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, "
    "true>(at::cuda::detail::TensorInfo<c10::BFloat16, unsigned int>, long, long)": "copy",
    # everything else
    "void at::native::vectorized_elementwise_kernel<2, at::native::CUDAFunctor_add<long>, std::array<char*, 3ul> >("
    "int, at::native::CUDAFunctor_add<long>, std::array<char*, 3ul>)": "other",
    "void at::native::vectorized_elementwise_kernel<2, at::native::BUnaryFunctor<long, long, long, at::native::"
    "binary_internal::div_floor_kernel_cuda(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda()#4}"
    "::operator()() const::{lambda(long, long)#1}>, std::array<char*, 2ul> >(int)": "other",
    "_compute_slot_mapping_kernel": "other",
}


@pytest.mark.parametrize("name,expected", list(NAMES.items()), ids=[n[:60] for n in NAMES])
def test_categorize_real_kernel_names(name: str, expected: str) -> None:
    assert categorize(name) == expected


def test_every_category_is_reachable() -> None:
    assert set(NAMES.values()) == set(CATEGORIES)


def _kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur}


def _trace() -> dict:
    """Two steps: a GEMM 100 us + decode attention 40 us each, one 10 us memcpy, host ops and vLLM step names."""
    gemm, dec = "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", "flashinfer::BatchDecodeWithPagedKVCacheKernel<>"
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 500.0},
        {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_8(8)", "ts": 300.0, "dur": 9.0},
        {"ph": "X", "cat": "user_annotation", "name": "execute_context_1(100)_generation_7(7)", "ts": 0.0, "dur": 9.0},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_1(100)_generation_7(7)", "ts": 1.0,
         "dur": 9.0},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "ts": 5.0},
        _kernel(gemm, 10.0, 100.0), _kernel(dec, 110.0, 40.0),
        _kernel(gemm, 300.0, 100.0), _kernel(dec, 400.0, 40.0),
        _kernel("Memcpy HtoD (Pinned -> Device)", 420.0, 10.0, cat="gpu_memcpy"),  # overlaps the decode kernel
    ]
    return {"schemaVersion": 1, "traceEvents": events}


def test_summarize_trace_per_category_per_step_and_top(tmp_path: Path) -> None:
    path = tmp_path / "t.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(_trace(), f)
    out = summarize_trace(path, num_steps=2, num_tokens=115, top=2)
    cats = out["categories"]
    assert cats["gemm"] == {"ms": 0.2, "ms_per_step": 0.1, "share": round(200 / 290, 4), "kernels_per_step": 1.0,
                            "ms_per_1k_tokens": round(0.2 / 115 * 1e3, 4)}
    assert cats["attention_decode"]["ms_per_step"] == 0.04
    assert cats["copy"]["ms"] == 0.01 and cats["copy"]["kernels_per_step"] == 0.5
    assert cats["norm"]["ms"] == 0.0 and set(cats) == set(CATEGORIES)
    assert out["kernel_ms_per_step"] == 0.145 and out["num_device_events"] == 5
    assert out["device_busy_ms_per_step"] == 0.14  # the memcpy overlaps the decode kernel
    assert out["device_span_ms_per_step"] == 0.215  # 10 us .. 440 us
    assert [k["category"] for k in out["top_kernels"]] == ["gemm", "attention_decode"]
    assert out["top_kernels"][0]["calls_per_step"] == 1.0 and out["top_kernels"][0]["ms"] == 0.2


def test_summarize_plain_json_and_an_empty_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_trace()))
    assert summarize_trace(path, 2)["kernel_ms"] == 0.29
    empty = summarize_trace({"traceEvents": []}, 3)
    assert empty["kernel_ms"] == 0.0 and empty["device_busy_ms_per_step"] == 0.0 and empty["top_kernels"] == []


def test_vllm_step_names_in_time_order_host_side_only() -> None:
    steps = step_annotations(_trace())
    assert steps == [{"prefill_seqs": 1, "prefill_tokens": 100, "decode_seqs": 7, "decode_tokens": 7},
                     {"prefill_seqs": 0, "prefill_tokens": 0, "decode_seqs": 8, "decode_tokens": 8}]
    summary = step_token_summary(steps)
    assert summary["tokens"] == 115 and summary["tokens_per_step"] == 57.5
    assert summary["prompt_tokens_per_step"] == 50.0 and summary["steps_with_prompt_tokens"] == 1
    assert step_token_summary([]) == {"num_steps": 0}


def test_read_step_log_window(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    rows = [{"kind": "split", "t": 0}] + [
        {"kind": "step", "t": i, "num_tokens": 100 + i, "num_seqs": 10, "num_prefill_seqs": 1} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    window = read_step_log(path, 2, 3)
    assert len(window) == 3
    assert window[0] == {"prefill_seqs": 1, "prefill_tokens": 102 - 9, "decode_seqs": 9, "decode_tokens": 9}


def test_markdown_table_ratio_and_missing_system() -> None:
    ours = summarize_trace(_trace(), 2, 115)
    ours["steps"] = {"tokens_per_step": 57.5}
    vllm = summarize_trace(_trace(), 1, 115)
    table = markdown_table({"ours": ours, "vllm": vllm})
    gemm_row = next(line for line in table.splitlines() if line.startswith("| gemm "))
    assert gemm_row.startswith("| gemm | 0.10 | 0.20 | 0.50 |")
    assert any(line.startswith("| attention (all) | 0.04 | 0.08 | 0.50") for line in table.splitlines())
    assert "| norm " not in table  # zero on both sides: left out
    only = markdown_table({"ours": ours, "vllm": {"error": "vLLM run failed"}})
    assert "| gemm | 0.10 | - | - |" in only


def _launch(corr: int, ts: float, name: str = "cudaLaunchKernel") -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": 2, "args": {"correlation": corr}}


def _launched_kernel(corr: int, ts: float, dur: float, name: str) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_device_time_goes_to_the_step_that_launched_it() -> None:
    """Kernels are placed by their launch's host time, not their own: a step launched ahead runs its kernels
    during the next step's range; a graph's kernels share their cudaGraphLaunch's correlation id."""
    gemm, attn = "nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT", "flashinfer::BatchPrefillWithPagedKVCacheKernel"
    events = [
        _launch(1, 5), _launched_kernel(1, 50, 100, gemm),  # launched before the first step: not placed
        _launch(2, 110, "cudaGraphLaunch"), _launched_kernel(2, 300, 40, gemm), _launched_kernel(2, 340, 10, attn),  # step 0
        _launch(3, 150), _launched_kernel(3, 350, 20, attn),  # step 0 still (its range began at 100)
        _launch(4, 210), _launched_kernel(4, 400, 30, gemm),  # step 1, running while step 2's range is open
        _launched_kernel(9, 500, 7, gemm),  # no launch in the trace
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 460, "dur": 4, "args": {"correlation": 5}},
        _launch(5, 320, "cudaMemcpyAsync"),  # step 2's copy
    ]
    per_step, left = per_step_device_ms({"traceEvents": events}, [100.0, 200.0, 300.0])
    # busy: step 0's kernels 300-340, 340-350 and 350-370 us back to back (70 us); step 1 alone
    assert per_step[0] == {"gemm": 0.04, "attention_prefill": 0.03, "all": 0.07, "busy": 0.07}
    assert per_step[1] == {"gemm": 0.03, "all": 0.03, "busy": 0.03}
    assert per_step[2] == {"copy": 0.004, "all": 0.004, "busy": 0.004}
    assert left == {"unmatched_ms": 0.007, "before_ms": 0.1}
    # two kernels of one step at once (two streams): summed in `all`, once in `busy`
    both = [_launch(1, 10), _launched_kernel(1, 100, 50, gemm), _launch(2, 11), _launched_kernel(2, 120, 50, attn)]
    per_step, _ = per_step_device_ms({"traceEvents": both}, [0.0])
    assert per_step[0]["all"] == pytest.approx(0.1) and per_step[0]["busy"] == pytest.approx(0.07)


def test_our_step_ranges_are_the_host_side_ones() -> None:
    """The profiler draws a record_function range twice: on the host and on the GPU's timeline."""
    events = [{"ph": "X", "cat": "user_annotation", "name": "bullet_step_7", "ts": 100.0, "dur": 50},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "bullet_step_7", "ts": 180.0, "dur": 40},
              {"ph": "X", "cat": "user_annotation", "name": "bullet_step_8", "ts": 150.0, "dur": 50},
              {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_8(8)", "ts": 1.0}]
    assert our_step_starts({"traceEvents": events}) == {7: 100.0, 8: 150.0}


def test_prompt_token_cost_recovers_the_decode_part_and_the_slope() -> None:
    """ms = 8 + 20 x (prompt tokens / 1k) for GEMMs, attention 1 + 2 per 1k; steps with other decode rows
    (outside 10% of the median, 64) are left out of the fit."""
    prompts = [0, 512, 1024, 0, 2048, 1500, 0, 256]
    steps = [{"prefill_tokens": p, "decode_tokens": 64} for p in prompts] + [{"prefill_tokens": 100, "decode_tokens": 8}]
    device = [{"gemm": 8 + 20 * p / 1e3, "attention_decode": 1.0, "attention_prefill": 2 * p / 1e3,
               "norm": 0.5, "all": 9.5 + 22 * p / 1e3} for p in prompts] + [{"gemm": 99.0, "all": 99.0}]
    fit = prompt_token_cost(steps, device)
    assert fit["num_steps"] == 8 and fit["num_steps_with_prompt_tokens"] == 5 and fit["decode_rows_median"] == 64
    assert fit["gemm"]["ms_per_1k_prompt_tokens"] == pytest.approx(20) and fit["gemm"]["intercept_ms"] == pytest.approx(8)
    assert fit["gemm"]["r2"] == pytest.approx(1) and fit["gemm"]["decode_only_ms"] == 8
    assert fit["attention"]["ms_per_1k_prompt_tokens"] == pytest.approx(2)
    assert fit["attention"]["intercept_ms"] == pytest.approx(1)
    assert fit["all"]["ms_per_1k_prompt_tokens"] == pytest.approx(22)
    assert fit["norm_act_rotary_triton"]["ms_per_1k_prompt_tokens"] == pytest.approx(0)
    assert prompt_token_cost([], []) == {"num_steps": 0}
    # no prompt tokens in the window: no line, only the decode-only mean
    flat = prompt_token_cost([{"prefill_tokens": 0, "decode_tokens": 64}] * 3, [{"all": 5.0}] * 3)
    assert flat["all"] == {"decode_only_ms": 5.0}


def test_prompt_cost_table_side_by_side() -> None:
    def result(slope: float) -> dict:
        prompts = [0, 1000, 2000, 500]
        steps = [{"prefill_tokens": p, "decode_tokens": 64} for p in prompts]
        device = [{"gemm": 5 + slope * p / 1e3, "all": 6 + slope * p / 1e3} for p in prompts]
        starts_free = prompt_token_cost(steps, device)
        return {"step_costs": {"fit": starts_free}}

    table = prompt_cost_table({"ours": result(22.0), "vllm": result(20.0)})
    assert "| gemm | 22.00 | 20.00 | 1.10 | 5.00 | 5.00 | 1.000 | 1.000 |" in table
    assert "| steps fitted (with prompt tokens) | 4 (3) | 4 (3) | | 64 rows | 64 rows | | |" in table
    assert "| gemm | 22.00 | - | - |" in prompt_cost_table({"ours": result(22.0), "vllm": {"error": "x"}})
    costs = step_costs({"traceEvents": []}, [1.0, 2.0], [{"prefill_tokens": 5, "decode_tokens": 3}] * 2)
    assert costs["per_step"] == [{"prompt_tokens": 5, "decode_rows": 3}] * 2


def test_matched_steps_compare_like_with_like(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only sizes both windows hold at least twice, with decode rows within 10%; --report prints it again."""
    def row(prompt: int, rows: int, gemm: float, attn: float) -> dict:
        return {"prompt_tokens": prompt, "decode_rows": rows, "gemm": gemm, "attention_prefill": attn,
                "all": gemm + attn}

    ours = [row(0, 64, 5.0, 4.0), row(0, 64, 5.2, 4.2), row(1985, 63, 38.0, 9.0), row(1985, 63, 38.4, 9.2),
            row(500, 63, 12.0, 5.0), row(500, 63, 12.0, 5.0), row(700, 63, 14.0, 5.0)]
    vllm = [row(0, 64, 5.1, 4.5), row(0, 63, 5.1, 4.5), row(1985, 63, 37.8, 7.2), row(1985, 63, 37.8, 7.2),
            row(500, 20, 9.0, 3.0), row(500, 20, 9.0, 3.0), row(700, 63, 14.0, 5.0), row(700, 63, 14.0, 5.0)]
    results = {"ours": {"step_costs": {"per_step": ours}}, "vllm": {"step_costs": {"per_step": vllm}}}
    table = matched_steps_table(results)
    assert "| 1985 | 2 / 2 | 63.0 / 63.0 | attention | 9.10 | 7.20 | +1.90 |" in table
    assert "| 0 | 2 / 2 | 64.0 / 63.5 | all | 9.20 | 9.60 | -0.40 |" in table
    assert "| 500 |" not in table and "| 700 |" not in table  # other decode rows; one step of ours
    saved = tmp_path / "kernel_compare.json"
    saved.write_text(json.dumps({"date": "d", **results}))
    assert main(["--report", str(saved)]) == 0
    assert "| 1985 | 2 / 2 |" in capsys.readouterr().out


CSV = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{i:02d}.0000000,{40 + 7 * i},{6 + i % 5}\n" for i in range(40))


@pytest.mark.slow
def test_cpu_smoke_ours_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Our engine on CPU with the profiler window, and a variant of it in the same call: the JSON and tables come
    out (no kernels on CPU), the variant's files beside the default's."""
    (tmp_path / "conv.csv").write_text(CSV)
    out = tmp_path / "out"
    assert main(["--systems", "ours,ours+scatter", "--device", "cpu", "--model", "dummy:tiny-llama", "--num-prompts", "12",
                 "--max-total-tokens", "256", "--warmup-steps", "3", "--profile-steps", "2",
                 "--trace-path", str(tmp_path), "--out", str(out)]) == 0
    result = json.loads((out / "kernel_compare.json").read_text())
    ours = result["ours"]
    assert "error" not in ours, ours
    assert ours["num_steps"] == 2 and ours["steps"]["num_steps"] == 2 and ours["steps"]["tokens"] > 0
    assert set(ours["categories"]) == set(CATEGORIES) and "vllm" not in result
    assert (out / "ours_prof" / "hybrid-trace.json.gz").is_file()
    variant = result["ours+scatter"]
    assert "error" not in variant and variant["num_steps"] == 2 and "BULLET_RAY_KV_WRITE=scatter" in variant["system"]
    assert (out / "ours_scatter_prof" / "hybrid-trace.json.gz").is_file() and (out / "ours_scatter_steps.jsonl").is_file()
    # every profiled step was named in the trace and matched to its step-log row (no kernels on CPU)
    assert len(ours["step_costs"]["per_step"]) == 2, ours["step_costs"]
    printed = capsys.readouterr().out
    assert "| category | ours ms/step | vLLM ms/step |" in printed and "| gemm | " in printed.split("least squares")[1]
    assert "; ours = ours+scatter:" in printed


@pytest.mark.slow
def test_cpu_smoke_window_past_the_run_is_an_error_not_a_crash(tmp_path: Path) -> None:
    (tmp_path / "conv.csv").write_text(CSV)
    out = tmp_path / "out"
    assert main(["--systems", "ours", "--device", "cpu", "--model", "dummy:tiny-llama", "--num-prompts", "4",
                 "--max-total-tokens", "256", "--warmup-steps", "5000", "--profile-steps", "2",
                 "--trace-path", str(tmp_path), "--out", str(out)]) == 0
    assert "fewer than 5002 steps" in json.loads((out / "kernel_compare.json").read_text())["ours"]["error"]


def test_our_variants_parse_and_report_each_against_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    """`ours+<variant>` systems: known ones parse, an unknown one names itself and the known; the tables print once
    per our system with it in the "ours" columns (the environment per run: the next test)."""
    import os

    from benchmarks.gpu.kernel_compare import OUR_VARIANTS, parse_systems, print_reports
    from benchmarks.offline import environment

    assert parse_systems("ours, ours+ragged,vllm") == ["ours", "ours+ragged", "vllm"]
    with pytest.raises(ValueError, match=r"ours\+fast.*known: ours, ours\+paged, ours\+ragged, ours\+scatter, ours\+vllminit"):
        parse_systems("ours+fast")
    with pytest.raises(SystemExit, match="ours\\+fast"):
        main(["--systems", "ours+fast"])
    variable = next(iter(OUR_VARIANTS["ragged"]))
    before = os.environ.get(variable)
    with environment(OUR_VARIANTS["ragged"]):
        assert os.environ[variable] == "ragged"
    assert os.environ.get(variable) == before

    ours, ragged, vllm = summarize_trace(_trace(), 2, 115), summarize_trace(_trace(), 4, 115), \
        summarize_trace(_trace(), 1, 115)
    print_reports({"ours": ours, "ours+ragged": ragged, "vllm": vllm}, "title")
    printed = capsys.readouterr().out
    assert "title:" in printed and "title; ours = ours+ragged:" in printed
    assert "| gemm | 0.10 | 0.20 | 0.50 |" in printed and "| gemm | 0.05 | 0.20 | 0.25 |" in printed


def test_each_of_our_runs_is_built_under_its_variants_environment(tmp_path: Path, monkeypatch) -> None:
    """main runs ours, then ours+ragged: the ragged switch is set during the variant's run only (and gone when the
    next run starts), each result names its switches and its files' stem."""
    import os

    from benchmarks.gpu import kernel_compare

    monkeypatch.delenv("BULLET_RAY_PREFILL_ATTENTION", raising=False)
    seen = []

    def fake_run(args, stem):
        seen.append((stem, os.environ.get("BULLET_RAY_PREFILL_ATTENTION")))
        from benchmarks.offline import engine_switches

        return {"system": "bullet_ray chunked", "engine_switches": engine_switches()}

    monkeypatch.setattr(kernel_compare, "_run_ours", fake_run)
    out = tmp_path / "out"
    assert main(["--systems", "ours+ragged,ours", "--device", "cpu", "--out", str(out), "--trace-path", str(tmp_path)]) == 0
    assert seen == [("ours_ragged", "ragged"), ("ours", None)]
    saved = json.loads((out / "kernel_compare.json").read_text())
    assert saved["ours+ragged"]["engine_switches"]["BULLET_RAY_PREFILL_ATTENTION"] == "ragged"
    assert saved["ours"]["engine_switches"]["BULLET_RAY_PREFILL_ATTENTION"] == "default"
    assert "BULLET_RAY_PREFILL_ATTENTION=ragged" in saved["ours+ragged"]["system"]
