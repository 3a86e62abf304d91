"""Llama-3.1-8B (dummy bf16 weights) on one GPU: prefill MFU, decode bandwidth, and transformers' generate.

Ceilings measured in the same run: bf16 GEMM 8192^3 (TFLOP/s) and device copy bandwidth (read + write).
Prefill: tokens/s and MFU at 1k, 4k, 16k tokens per batch (2k-token sequences). Decode: step time and
achieved bandwidth ((weights + KV bytes read) / step time) at batch 1/16/64/256 x context 1k/4k (pairs whose
KV does not fit are skipped and listed), eager and replayed through the decode CUDA graphs (batch padded
to its bucket; graph vs eager hidden-state difference reported). Graph decode is timed two ways: `ms`, one
step at a time with the host's plan inside the timed span (the GPU idles while the host plans: what an
engine that waits for each step's tokens gets), and `pipelined_ms`, steps issued back to back so the host
plans step k+1 while the GPU runs step k (the GPU's own step time: what an engine that overlaps
scheduling with the GPU gets). transformers' generate on the same
model (all 32 layers, same weights, bf16, GPU) at batch 1 and 16 for comparison. From step_checks.py:
kernels and host launch calls per step (eager decode, graph decode, chunked mixed, prefill) and the chunked
schedule's greedy tokens with decode graphs vs eager.

    python -m benchmarks.gpu.engine_speed
    python -m benchmarks.gpu.engine_speed --prefill-gemm cublaslt   # the projections through tuned cuBLASLt algorithms

With `--prefill-gemm cublaslt` every figure is taken with the model's projections routed as the chunked schedule's
worker routes them (`bullet_ray.engine.lt_gemm.tune_and_route` on the whole GPU, decode batches' rows included);
the JSON is `gpu_engine_speed_h100_cublaslt.json`, with the tuning's report. Each run's bandwidth fractions are
against its own copy bandwidth, so two runs' fractions can be set side by side; their absolute times cannot.
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch
from tqdm import tqdm

from benchmarks.gpu.common import copy_bandwidth_gbs, peak_gemm_tflops, save, time_back_to_back, time_cuda
from benchmarks.gpu.engine_common import make_runner
from benchmarks.gpu.step_checks import chunked_graphs_vs_eager, step_kernel_counts
from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.engine.sequence import Sequence
from bullet_ray.models.loader import load_model

BLOCK = 16


def _seqs(n: int, ctx: int, new: int) -> list[Sequence]:
    from bullet_ray.engine.sampler import SamplingState
    from bullet_ray.engine.sampling_params import SamplingParams

    per = (ctx + new + BLOCK - 1) // BLOCK
    seqs = []
    for i in range(n):
        ids = [(i * 7 + j) % 1000 + 10 for j in range(ctx)]
        s = Sequence(f"r{i}", ids, SamplingState(SamplingParams(temperature=0.0, max_tokens=8), ids), 0.0, 1 << 20)
        s.block_ids = list(range(i * per, (i + 1) * per))
        seqs.append(s)
    return seqs


@torch.inference_mode()
def forward_ms(runner, batch) -> float:
    ids, pos, md = runner.build_metadata(batch)

    def step():
        runner.backend.begin_batch(md)
        h = runner.model.forward(ids, pos, AttentionContext(runner.backend, md))
        last = md.query_start_loc[1:].long() - 1
        return runner.model.compute_logits(h[last])

    return time_cuda(step, iters=5, warmup=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-gemm", choices=["cublas", "cublaslt", "cublaslt-all"], default="cublas",
                        help="the model's projections: PyTorch's cuBLAS (default) or cuBLASLt algorithms tuned on the "
                             "whole GPU at start, as engine.prefill_gemm on the chunked schedule")
    args = parser.parse_args(argv)
    peak = peak_gemm_tflops()
    bw = copy_bandwidth_gbs()
    print(f"bf16 GEMM peak {peak:.0f} TFLOP/s, copy bandwidth {bw:.0f} GB/s")
    loaded = load_model("dummy:llama-3.1-8b", dtype=torch.bfloat16, device="cuda", show_progress=True)
    model, cfg = loaded.model, loaded.config
    router, gemm_report = None, None
    if args.prefill_gemm != "cublas":
        from bullet_ray.engine import lt_gemm

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        routed = lt_gemm.tune_and_route(model, [lt_gemm.Place(0, sms, None)], args.prefill_gemm, 16384,
                                        torch.device("cuda"), sms, whole=True,
                                        progress=lambda it: tqdm(it, desc="GEMM algorithms"))
        if routed is not None:
            router, report = routed
            gemm_report = {k: v for k, v in report.items() if k != "choices"}
            print("projections through cuBLASLt:", gemm_report, flush=True)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_per_token = cfg.kv_bytes_per_token(2)
    free = torch.cuda.mem_get_info()[0]
    num_blocks = int((free - (6 << 30)) // (kv_per_token * BLOCK))
    runner, kv = make_runner(model, cfg, "flashinfer", num_blocks, BLOCK, "cuda", torch.bfloat16)
    kv.normal_()  # never time on zeros
    capacity = num_blocks * BLOCK
    flops_per_token = 2 * (cfg.num_params - cfg.vocab_size * cfg.hidden_size)  # matmuls (embedding is a lookup)
    prefill = {}
    for total in tqdm([1024, 4096, 16384], desc="prefill"):
        seq_len = min(total, 2048)
        seqs = _seqs(total // seq_len, seq_len, 1)
        ms = forward_ms(runner, [ScheduledSeq(s, seq_len) for s in seqs])
        attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * (seq_len ** 2 / 2) * len(seqs)
        flops = flops_per_token * total + attn
        prefill[str(total)] = {"ms": round(ms, 2), "tokens_per_s": round(total / (ms / 1e3)),
                               "tflops": round(flops / (ms / 1e3) / 1e12, 1), "mfu": round(flops / (ms / 1e3) / 1e12 / peak, 3)}
        print(total, prefill[str(total)])
    decode, skipped = {}, []
    for bs in tqdm([1, 16, 64, 256], desc="decode"):
        for ctx in (1024, 4096):
            if bs * (ctx + 16) > capacity:
                skipped.append(f"bs{bs}_ctx{ctx}")
                continue
            seqs = _seqs(bs, ctx, 1)
            for s in seqs:
                s.num_computed_tokens = ctx - 1  # the KV of the context is in the pool; decode the last token
            ms = forward_ms(runner, [ScheduledSeq(s, 1) for s in seqs])
            read = weight_bytes + bs * ctx * kv_per_token
            decode[f"bs{bs}_ctx{ctx}"] = {"ms": round(ms, 3), "tokens_per_s": round(bs / (ms / 1e3)),
                                          "gb_per_s": round(read / (ms / 1e3) / 1e9), "bw_frac": round(read / (ms / 1e3) / 1e9 / bw, 3)}
            print(bs, ctx, decode[f"bs{bs}_ctx{ctx}"])
    graphs_result = decode_with_graphs(runner, cfg, num_blocks, capacity, weight_bytes, kv_per_token, bw)
    # the same graphs with padding rows writing row 0's slot, row 0 last (two scatters a layer): the path before
    # the pool's scratch block, timed in the same run
    row0_last = decode_with_graphs(runner, cfg, num_blocks, capacity, weight_bytes, kv_per_token, bw, scratch=False)
    try:
        kernels = decode_kernel_breakdown(runner, 64, 1024)
    except Exception as exc:  # noqa: BLE001 - the profile is a diagnostic; keep the figures without it
        kernels = {"error": repr(exc)}
    del runner, kv
    gc.collect()
    torch.cuda.empty_cache()
    steps: dict = {}
    for name, check in (("kernels_per_step", step_kernel_counts), ("chunked_graphs_vs_eager", chunked_graphs_vs_eager)):
        try:
            steps[name] = check(model, cfg)
        except Exception as exc:  # noqa: BLE001 - a failed check is reported, the rest is kept
            steps[name] = {"error": repr(exc)}
        print(name, steps[name], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    try:
        hf = hf_generate(cfg, model)
    except Exception as exc:  # noqa: BLE001 - keep the engine's figures when transformers fails
        hf = {"error": repr(exc)}
    if router is not None:
        gemm_report["calls"] = dict(router.calls)
        router.close()
    name = "gpu_engine_speed_h100" + ("" if args.prefill_gemm == "cublas" else f"_{args.prefill_gemm}")
    save(name, {"prefill_gemm": args.prefill_gemm, "prefill_gemm_report": gemm_report,
                "peak_gemm_tflops": round(peak), "copy_bandwidth_gbs": round(bw),
                "weights_gb": round(weight_bytes / 1e9, 2), "kv_blocks": num_blocks,
                "prefill": prefill, "decode": decode, "decode_skipped_no_memory": skipped,
                "decode_cuda_graphs": graphs_result, "decode_cuda_graphs_row0_last": row0_last,
                "decode_kernels_bs64_ctx1024": kernels,
                **steps,
                "transformers_generate": hf,
                "notes": "prefill and 'decode': eager PyTorch + flashinfer kernels; "
                         "'decode_cuda_graphs': the same decode step replayed as a CUDA graph "
                         "(padding rows write the pool's scratch block; "
                         "'decode_cuda_graphs_row0_last': row 0's slot, row 0 written last; "
                         "ms: one step at a time, host plan included; pipelined_ms: "
                         "back to back, host planning overlapped with the GPU); "
                         "decode steps include the lm_head and the graph's host-side plan"})
    print(f"GEMM {peak:.0f} TFLOP/s, copy {bw:.0f} GB/s")
    for k, v in prefill.items():
        print(f"prefill {k:>6} tokens: {v['ms']:8.2f} ms {v['tokens_per_s']:>7} tok/s MFU {v['mfu']:.3f}")
    for k, v in graphs_result.items():
        if isinstance(v, dict):
            e = decode.get(k, {})
            print(f"decode {k:>14}: graphs {v['ms']:7.3f} ms {v['gb_per_s']:>5} GB/s ({v['bw_frac']:.3f}), "
                  f"pipelined {v['pipelined_ms']:7.3f} ms ({v['pipelined_bw_frac']:.3f}); "
                  f"eager {e.get('ms', float('nan')):7.3f} ms")
            r = row0_last.get(k, {})
            print(f"{'':>22}row 0 last: {r.get('ms', float('nan')):7.3f} ms ({r.get('bw_frac', float('nan')):.3f}), "
                  f"pipelined {r.get('pipelined_ms', float('nan')):7.3f} ms ({r.get('pipelined_bw_frac', float('nan')):.3f})")
    print("transformers", hf)
    return 0


@torch.inference_mode()
def decode_with_graphs(runner, cfg, num_blocks: int, capacity: int, weight_bytes: int, kv_per_token: int,
                       bw: float, scratch: bool = True) -> dict:
    """Decode steps through DecodeGraphs; with `scratch` padding rows write the pool's last block (as a KVPool's
    scratch block: the batches below leave it free), else row 0's slot with row 0 written last."""
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(runner.model, runner.backend, BLOCK, 256, (4096 + 2 * BLOCK) // BLOCK + 1,
                          torch.device("cuda"), scratch_slot=(num_blocks - 1) * BLOCK if scratch else None)
    out = {}
    for bs in (1, 16, 64, 256):
        for ctx in (1024, 4096):
            if bs * (ctx + 16) > capacity - BLOCK:
                continue
            seqs = _seqs(bs, ctx, 1)
            for s in seqs:
                s.num_computed_tokens = ctx - 1
            batch = [ScheduledSeq(s, 1) for s in seqs]
            ids, pos, md = runner.build_metadata(batch)
            tables = [s.block_ids[:(ctx + BLOCK - 1) // BLOCK] for s in seqs]
            runner.backend.begin_batch(md)
            eager = runner.model.forward(ids, pos, AttentionContext(runner.backend, md)).float()
            graph_hidden = graphs.run(0, ids, pos, md, tables).float()
            rel = float((graph_hidden - eager).norm() / eager.norm())

            def step(ids=ids, pos=pos, md=md, tables=tables):
                h = graphs.run(0, ids, pos, md, tables)
                return runner.model.compute_logits(h)

            ms = time_cuda(step, iters=10, warmup=2)
            pipelined = time_back_to_back(step, iters=20, warmup=3)
            read = weight_bytes + bs * ctx * kv_per_token
            out[f"bs{bs}_ctx{ctx}"] = {"ms": round(ms, 3), "tokens_per_s": round(bs / (ms / 1e3)),
                                       "gb_per_s": round(read / (ms / 1e3) / 1e9), "bw_frac": round(read / (ms / 1e3) / 1e9 / bw, 3),
                                       "pipelined_ms": round(pipelined, 3),
                                       "pipelined_bw_frac": round(read / (pipelined / 1e3) / 1e9 / bw, 3),
                                       "graph_vs_eager_rel_diff": rel}
            print("graphs", bs, ctx, out[f"bs{bs}_ctx{ctx}"], flush=True)
    out["num_graph_captures"] = graphs.num_captures
    out["num_plans"], out["num_plans_reused"] = graphs.num_plans, graphs.num_plans_reused  # flashinfer plans skipped
    return out


@torch.inference_mode()
def decode_kernel_breakdown(runner, bs: int, ctx: int, top: int = 12) -> dict:
    """GPU time per kernel kind of one eager decode step (torch.profiler): where the step's time goes, and
    how much of it is small kernels rather than weight and KV reads."""
    from torch.profiler import ProfilerActivity, profile

    seqs = _seqs(bs, ctx, 1)
    for s in seqs:
        s.num_computed_tokens = ctx - 1
    ids, pos, md = runner.build_metadata([ScheduledSeq(s, 1) for s in seqs])

    def step():
        runner.backend.begin_batch(md)
        h = runner.model.forward(ids, pos, AttentionContext(runner.backend, md))
        return runner.model.compute_logits(h)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    def own_us(e) -> float:  # a kernel's own GPU time; 0 for host-side ops (their kernels are rows of their own)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

    rows = [(e.key, e.count, own_us(e)) for e in prof.key_averages() if own_us(e) > 0]
    rows.sort(key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    return {"batch": bs, "context": ctx, "kernel_time_ms": round(total_us / 1e3, 3),
            "num_kernels": sum(r[1] for r in rows),
            "top": [{"kernel": k[:120], "count": c, "ms": round(t / 1e3, 3), "share": round(t / total_us, 3)}
                    for k, c, t in rows[:top]]}


@torch.inference_mode()
def hf_generate(cfg, ours) -> dict:
    """transformers' generate on the same architecture and weights; our decode at the same batch and context."""
    import time

    from transformers import AutoConfig, AutoModelForCausalLM

    hf_cfg = AutoConfig.for_model(**cfg.to_hf_dict())
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16)
    hf = hf.to_empty(device="cuda")
    sd = ours.state_dict()
    c = cfg
    new = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"], "model.norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q, k, v = sd[p + "self_attn.qkv_proj.weight"].split([c.q_size, c.kv_size, c.kv_size])
        g, u = sd[p + "mlp.gate_up_proj.weight"].chunk(2)
        new.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": sd[p + "self_attn.o_proj.weight"], p + "mlp.gate_proj.weight": g,
                    p + "mlp.up_proj.weight": u, p + "mlp.down_proj.weight": sd[p + "mlp.down_proj.weight"],
                    p + "input_layernorm.weight": sd[p + "input_layernorm.weight"],
                    p + "post_attention_layernorm.weight": sd[p + "post_attention_layernorm.weight"]})
    hf.load_state_dict(new, strict=False)
    hf.model.rotary_emb.__init__(hf_cfg, device="cuda")
    results = {}
    for bs in (1, 16):
        ids = torch.randint(10, 1000, (bs, 512), device="cuda")
        hf.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False)
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        results[f"bs{bs}"] = {"prompt_tokens": 512, "new_tokens": 128, "seconds": round(secs, 2),
                              "output_tokens_per_s": round(bs * 128 / secs)}
        print("transformers", bs, results[f"bs{bs}"])
    del hf
    return results


if __name__ == "__main__":
    sys.exit(main())
