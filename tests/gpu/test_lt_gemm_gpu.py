"""engine.prefill_gemm: cublaslt on the GPU (dummy SmolLM2-135M shapes, bullet schedule, green contexts where
present): the prefill worker times cuBLASLt's algorithms on each of its partitions at start, its step log's `startup`
record keeps every point, and the greedy tokens agree with PyTorch's cuBLAS (other kernels: bf16 near-ties aside).

Run: python -m pytest tests/gpu/test_lt_gemm_gpu.py -q
"""

from __future__ import annotations

import pytest

from tests.gpu.logged_run import run_logged

pytestmark = pytest.mark.gpu


def _needs_green_contexts() -> None:
    """The prefill side's partitions are green contexts; without them there is nothing to tune (a skip, not a fail)."""
    from bullet_ray.gpu import smctl

    caps = smctl.capability_report(0)
    if not caps.green_ctx_supported:
        pytest.skip(f"green contexts unsupported here: {caps.reason}")

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 600, 1500, 17, 1000, 3])]


def _run(tmp_path, gemm: str):
    tokens, records, _ = run_logged(tmp_path / f"steps-{gemm}.jsonl", PROMPTS, 24, schedule="bullet",
                                    split_policy="slo", max_num_batched_tokens=2048, prefill_gemm=gemm)
    startup = [r for r in records if r["kind"] == "startup" and r.get("role") == "prefill"]
    return tokens, startup


def test_cublaslt_prefill_gemm_tunes_every_partition_and_agrees_with_cublas(tmp_path, monkeypatch):
    _needs_green_contexts()
    monkeypatch.setenv("BULLET_RAY_LT_GEMM_CACHE", str(tmp_path / "lt_gemm.json"))  # tuned afresh, then cached
    plain, _ = _run(tmp_path, "cublas")
    routed, startup = _run(tmp_path, "cublaslt")
    assert all(len(t) == 24 for t in routed)
    assert [t[0] for t in routed] == [t[0] for t in plain]
    same = sum(a == b for r, p in zip(routed, plain) for a, b in zip(r, p))
    assert same / sum(len(p) for p in plain) >= 0.9
    report = startup[0]["prefill_gemm"]
    assert report["gemm"] == "cublaslt" and report["tokens"] == [256, 512, 1024, 2048]
    # every point of every partition where cuBLAS's grid wastes SM-rounds timed F.linear and at least one algorithm
    assert report["points"] == len(report["choices"]) > 0
    from bullet_ray.engine.lt_gemm import wave_efficiency

    device_sms = report["device_sms"]
    assert all(p["candidates"] > 0 and p["base_ms"] > 0 and wave_efficiency(p["sms"], device_sms) < 0.9
               for p in report["choices"])
    # SmolLM2's GEMMs take microseconds: F.linear may keep every point; whatever was kept was launched without fault
    assert report["calls"]["launch_failed"] == 0
    assert (report["kept"] > 0) == (report["calls"]["routed"] > 0)
    assert report["cached"] == 0 and (tmp_path / "lt_gemm.json").exists()
    # the default, auto, is cublaslt on a bullet prefill worker: the same choices, read back from the cache
    _, auto_startup = _run(tmp_path, "auto")
    auto = auto_startup[0]["prefill_gemm"]
    assert auto["gemm"] == "cublaslt" and auto["cached"] == auto["points"] == report["points"]


def test_the_chunked_schedule_tunes_the_whole_gpu_and_keeps_its_report(tmp_path, monkeypatch):
    """The chunked schedule's one worker: one place (the whole GPU), its graphs captured on a side stream still routed
    (the place is WHOLE_GPU, whatever stream captures), its decode graphs' report beside prefill_gemm's."""
    monkeypatch.setenv("BULLET_RAY_LT_GEMM_CACHE", "off")
    plain, _, _ = run_logged(tmp_path / "chunked.jsonl", PROMPTS, 24, schedule="chunked", max_num_batched_tokens=2048)
    routed, records, _ = run_logged(tmp_path / "chunked-lt.jsonl", PROMPTS, 24, schedule="chunked",
                                    max_num_batched_tokens=2048, prefill_gemm="cublaslt")
    same = sum(a == b for r, p in zip(routed, plain) for a, b in zip(r, p))
    assert same / sum(len(p) for p in plain) >= 0.9
    startup = [r for r in records if r["kind"] == "startup" and r.get("role") == "hybrid"]
    report = startup[0]["prefill_gemm"]
    assert {p["sms"] for p in report["choices"]} == {report["device_sms"]} and report["cache"] == "None"
    assert report["calls"]["launch_failed"] == 0 and (report["kept"] > 0) == (report["calls"]["routed"] > 0)
    assert startup[0].get("decode_graphs")  # the decode graphs' count, from the report that no longer drops ours


def test_the_real_cublaslt_path_on_a_green_partition():
    """In process, Llama-3.1-8B's qkv shape on the prefill side of a 16 / 116 split: the tuner times real candidates
    (each checked against F.linear), the router launches the fastest through libcublasLt on the partition's stream,
    eagerly and inside a CUDA graph, with F.linear's result; on a stream without a choice it runs F.linear."""
    import torch
    import torch.nn.functional as F

    from bullet_ray.engine.lt_gemm import LtGemmRouter, LtGemmTuner, LtLib, Place, rel_error
    from bullet_ray.gpu.partition import make_partitioner

    _needs_green_contexts()

    torch.zeros(1, device="cuda")
    part = make_partitioner("green", "both", 0, [16])
    lt = LtLib.open()
    try:
        stream = part.stream(0, "prefill")
        device_sms = torch.cuda.get_device_properties(0).multi_processor_count
        # a negative margin keeps the fastest algorithm even if F.linear is faster: the launch is what is tested
        tuner = LtGemmTuner(lt, device_sms, margin=-10.0)
        n, k, m = 6144, 4096, 2048
        choice = tuner.tune_point(Place(0, part.ladder[0].prefill_sms, stream), m, n, k)
        assert choice.candidates > 0 and choice.base_ms > 0 and choice.algo is not None, choice
        router = LtGemmRouter(lt, {(int(stream.cuda_stream), n, k): [choice]})
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, w)
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            eager = router.linear(w, x)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            router.linear(w, x, out)  # the plan is made here, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                router.linear(w, x, out)
            out.zero_()
            graph.replay()
        torch.cuda.synchronize()
        assert rel_error(eager, ref) < 0.02 and rel_error(out, ref) < 0.02
        assert router.calls["routed"] == 3 and router.calls["launch_failed"] == 0
        assert rel_error(router.linear(w, x), ref) < 0.02 and router.calls["f_linear"] == 1  # the default stream
        print(f"qkv {m} rows on {part.ladder[0].prefill_sms} SMs: F.linear {choice.base_ms:.3f} ms, {choice.label} "
              f"{choice.ms:.3f} ms ({choice.source}, target {choice.sm_target}, {choice.candidates} candidates)")
    finally:
        lt.close()
        part.close()
