"""GPU correctness: bf16 + flashinfer greedy output vs the CPU float32 torch reference, same random weights.

For each tiny family (random weights, head_dim 128 as flashinfer needs): 64 greedy tokens per prompt,
prefilled in one batch then decoded in batches through the runner (eager, then through CUDA graphs):
- free-running token agreement with the reference (target >= 95%) and the first divergence;
- the relative norm of the step-0 next-token logits difference (target < 2e-2);
- teacher-forced agreement (the reference's tokens fed back at every step), and for each disagreement
  the reference's own top-1/top-2 logit margin next to the step's logit error: random weights give
  near-uniform logits, so a flip where the margin is below the bf16 error is a near tie, not a bug
  (`clear_margin_disagreements` counts flips where the margin exceeds 2x that step's error; target 0).

    python -m benchmarks.gpu.engine_correctness          (CPU smoke run: --device cpu --backend torch)
    python -m benchmarks.gpu.engine_correctness --device cpu --backend torch --dtype bfloat16 \
        --name cpu_bf16_control_correctness          (the control: bf16 with PyTorch's CPU kernels only)

With `--chunked-check`, each family (or the `--model`) also runs `step_checks.chunked_graphs_vs_eager`: the chunked
schedule's greedy tokens with decode graphs against eager, and each token's top-1 over top-2 margin. On real weights
(peaked logits) it says whether the graph/eager parting `engine_speed` reports on the dummy Llama-3.1-8B (flat logits)
is only near ties.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch

from benchmarks.gpu.common import save
from benchmarks.gpu.engine_common import greedy, make_runner, make_seqs
from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.models.loader import load_model, preset_hf_config

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
NUM_NEW, BLOCK, MAX_LEN = 64, 16, 256
PROMPT_LENGTHS = (7, 33, 90, 150)
TEXT_PROMPTS = (
    "The capital of France is",
    "Write a short story about a robot who learns to paint. Once upon a time, in a small workshop at the edge "
    "of a busy city, there lived a robot named",
    "Explain in simple terms how a CPU cache works, why it makes programs faster, and what a cache miss is. "
    "Start with an analogy that a child could understand, then give the technical details step by step.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
)


def _gpu_config(family: str) -> str:
    """The tiny preset with head_dim 128 (flashinfer's kernels need 64/128/256), as dummy:<config.json>."""
    cfg = preset_hf_config(family)
    cfg.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512)
    path = os.path.join(tempfile.mkdtemp(), f"{family}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return f"dummy:{path}"


@torch.inference_mode()
def forced_logits(runner: Any, prompts: list[list[int]], ref: list[list[int]]) -> list[torch.Tensor]:
    """Teacher forcing: the float32 next-token logits [num_new, vocab] of every prompt at every step, the
    reference's tokens fed back."""
    seqs = make_seqs(prompts, NUM_NEW, BLOCK, MAX_LEN)
    rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step in range(NUM_NEW):
        batch = [ScheduledSeq(s, s.num_uncomputed_tokens) for s in seqs]
        ids, pos, md = runner.build_metadata(batch)
        runner.backend.begin_batch(md)
        hidden = runner.model.forward(ids, pos, AttentionContext(runner.backend, md))
        last = torch.tensor(md.query_start_loc.tolist()[1:], device=hidden.device) - 1
        logits = runner.model.compute_logits(hidden[last]).float().cpu()
        for i, s in enumerate(seqs):
            rows[i].append(logits[i])
            s.num_computed_tokens += batch[i].num_new_tokens
            s.sampling.append(ref[i][step])
    return [torch.stack(r) for r in rows]


def compare(ref_logits: list[torch.Tensor], out_logits: list[torch.Tensor]) -> dict[str, Any]:
    agree, flips, clear = [], [], 0
    for i, (lr, lo) in enumerate(zip(ref_logits, out_logits)):
        top2 = lr.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        err = (lo - lr).abs().max(dim=-1).values  # the step's largest logit error
        same = lr.argmax(-1) == lo.argmax(-1)
        agree.append(float(same.float().mean()))
        for step in (~same).nonzero().flatten().tolist():
            is_clear = bool(margin[step] > 2 * err[step])
            clear += int(is_clear)
            flips.append({"prompt": i, "step": step, "ref_margin": round(float(margin[step]), 5),
                          "max_logit_error": round(float(err[step]), 5), "clear_margin": is_clear})
    margins = torch.cat([lr.topk(2, dim=-1).values.diff(dim=-1).abs().flatten() for lr in ref_logits])
    errors = torch.cat([(lo - lr).abs().max(dim=-1).values for lr, lo in zip(ref_logits, out_logits)])
    return {"teacher_forced_agreement": agree, "disagreements": flips, "clear_margin_disagreements": clear,
            "median_ref_margin": round(float(margins.median()), 5),
            "median_max_logit_error": round(float(errors.median()), 5)}


def run_family(fam: str, prompts: list[list[int]], device: str, backend: str, dtype: torch.dtype,
               use_graphs: bool, source: str | None = None, chunked: bool = False) -> dict[str, Any]:
    """`fam`'s random-weight config, or the model at `source` (real weights, loaded twice from the file: float32 on
    CPU, `dtype` on `device`); with `chunked`, also `chunked_check` on the `device` copy."""
    is_random = source is None
    source = source or _gpu_config(fam)
    cpu = load_model(source, dtype=torch.float32, device="cpu", show_progress=False, seed=3)
    dev = load_model(source, dtype=dtype, device=device, show_progress=False, seed=3)
    if is_random:  # the same random draw on both sides
        dev.model.load_state_dict({k: v.to(dtype) for k, v in cpu.model.state_dict().items()}, strict=False)
        dev.model.rotary.inv_freq.copy_(cpu.model.rotary.inv_freq)
    ref_runner, _ = make_runner(cpu.model, cpu.config, "torch", 64, BLOCK, "cpu", torch.float32)
    runner, _ = make_runner(dev.model, dev.config, backend, 64, BLOCK, device, dtype)
    ref = greedy(ref_runner, prompts, NUM_NEW, BLOCK, MAX_LEN)
    out = greedy(runner, prompts, NUM_NEW, BLOCK, MAX_LEN)
    result: dict[str, Any] = {}
    if use_graphs:
        from bullet_ray.engine.cuda_graphs import DecodeGraphs

        runner.graphs = DecodeGraphs(dev.model, runner.backend, BLOCK, 8, MAX_LEN // BLOCK, torch.device(device))
        out_graphs = greedy(runner, prompts, NUM_NEW, BLOCK, MAX_LEN)
        runner.graphs = None
        result["graphs_equal_eager_tokens"] = out_graphs == out
    agree = [sum(a == b for a, b in zip(r, o)) / NUM_NEW for r, o in zip(ref, out)]
    first_div = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out)]
    ref_logits = forced_logits(ref_runner, prompts, ref)
    out_logits = forced_logits(runner, prompts, ref)
    step0 = torch.stack([lg[0] for lg in out_logits])
    step0_ref = torch.stack([lg[0] for lg in ref_logits])
    rel = float((step0 - step0_ref).norm() / step0_ref.norm())
    result.update({"token_agreement": agree, "mean_agreement": sum(agree) / len(agree), "first_divergence": first_div,
                   "step0_logits_rel_norm_diff": rel, **compare(ref_logits, out_logits)})
    result["passes_free_running"] = min(agree) >= 0.95 and rel < 2e-2
    result["passes_margin_aware"] = result["clear_margin_disagreements"] == 0 and rel < 2e-2
    if chunked:
        del ref_runner, runner, cpu
        result["chunked_graphs_vs_eager"] = chunked_check(dev.model, dev.config, device)
    return result


def chunked_check(model: Any, config: Any, device: str) -> dict[str, Any]:
    """`step_checks.chunked_graphs_vs_eager` on a loaded model, with the prompt lengths its context holds."""
    from benchmarks.gpu.step_checks import CHUNKED_CHECK_LENGTHS, chunked_graphs_vs_eager

    num_new = 48
    lengths = [n for n in CHUNKED_CHECK_LENGTHS if n + num_new <= config.max_position_embeddings]
    try:
        return chunked_graphs_vs_eager(model, config, num_new=num_new, device=device, lengths=lengths)
    finally:
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="flashinfer")
    ap.add_argument("--name", default="gpu_engine_correctness_h100")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                    help="the compared side's dtype (default bfloat16 on cuda, float32 on cpu); --device cpu "
                         "--backend torch --dtype bfloat16 is the control: bf16 without any GPU kernel")
    ap.add_argument("--model", default=None,
                    help="a real model (HF folder or .gguf, e.g. the embedded SmolLM2) instead of the random tiny "
                         "families; prompts are English text through its tokenizer")
    ap.add_argument("--chunked-check", action="store_true",
                    help="also the chunked schedule's greedy tokens with decode graphs against eager "
                         "(step_checks.chunked_graphs_vs_eager; on CPU both sides eager, a smoke run)")
    args = ap.parse_args(argv)
    on_gpu = args.device == "cuda"
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    families: dict[str, str | None] = {fam: None for fam in FAMILIES}
    if args.model:
        from bullet_ray.models.loader import load_tokenizer, resolve_source

        tokenizer = load_tokenizer(resolve_source(args.model).tokenizer_path)
        prompts = [tokenizer.encode(text) for text in TEXT_PROMPTS]
        families = {os.path.basename(args.model.rstrip("/")): args.model}
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    results = {}
    for fam, source in families.items():
        results[fam] = run_family(fam, prompts, args.device, args.backend, dtype, use_graphs=on_gpu, source=source,
                                  chunked=args.chunked_check)
        r = results[fam]
        if args.chunked_check:
            c = r["chunked_graphs_vs_eager"]
            print(f"{fam}: chunked schedule, graphs vs eager: rows equal {c['rows_equal']}, parting at "
                  f"{c['first_divergence']}, margins there {c['margin_at_divergence']}", flush=True)
        print(f"{fam}: free-running agreement {[round(a, 3) for a in r['token_agreement']]} first divergence "
              f"{r['first_divergence']}, step-0 logits rel diff {r['step0_logits_rel_norm_diff']:.2e}, "
              f"teacher-forced {[round(a, 3) for a in r['teacher_forced_agreement']]}, "
              f"clear-margin flips {r['clear_margin_disagreements']}, graphs==eager {r.get('graphs_equal_eager_tokens')}",
              flush=True)
    save(args.name, {"prompt_lengths": [len(p) for p in prompts], "model": args.model or "random tiny families", "num_new_tokens": NUM_NEW, "block_size": BLOCK,
                     "dtype": str(dtype).removeprefix("torch."), "device": args.device, "backend": args.backend,
                     "families": results})
    print(f"{'family':12} {'min agree':>9} {'mean':>6} {'step0 rel':>10} {'forced min':>10} {'clear flips':>11}")
    for fam, r in results.items():
        print(f"{fam:12} {min(r['token_agreement']):9.3f} {r['mean_agreement']:6.3f} "
              f"{r['step0_logits_rel_norm_diff']:10.2e} {min(r['teacher_forced_agreement']):10.3f} "
              f"{r['clear_margin_disagreements']:11d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
