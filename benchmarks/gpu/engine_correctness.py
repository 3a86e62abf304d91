"""GPU correctness: bf16 + flashinfer greedy output vs the CPU float32 torch reference, same random weights.

For each tiny family: share of the 64 generated tokens per prompt that agree (target >= 95%), the first
divergence, and the relative norm of the step-0 logits difference (target < 2e-2).

    python -m benchmarks.gpu.engine_correctness
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from benchmarks.gpu.common import save
from benchmarks.gpu.engine_common import first_logits, forced_agreement, greedy, make_runner
from bullet_ray.models.loader import load_model, preset_hf_config

FAMILIES = ["tiny-llama", "tiny-qwen2", "tiny-qwen3"]
NUM_NEW, BLOCK, MAX_LEN = 64, 16, 256


def _gpu_config(family: str) -> str:
    """The tiny preset with head_dim 128 (flashinfer's kernels need 64/128/256), as dummy:<config.json>."""
    cfg = preset_hf_config(family)
    cfg.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, intermediate_size=512)
    path = os.path.join(tempfile.mkdtemp(), f"{family}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return f"dummy:{path}"


def main() -> int:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 33, 90, 150)]
    results = {}
    for fam in FAMILIES:
        source = _gpu_config(fam)
        cpu = load_model(source, dtype=torch.float32, device="cpu", show_progress=False, seed=3)
        gpu = load_model(source, dtype=torch.bfloat16, device="cuda", show_progress=False, seed=3)
        gpu.model.load_state_dict({k: v.to(torch.bfloat16) for k, v in cpu.model.state_dict().items()}, strict=False)
        gpu.model.rotary.inv_freq.copy_(cpu.model.rotary.inv_freq)
        ref_runner, _ = make_runner(cpu.model, cpu.config, "torch", 64, BLOCK, "cpu", torch.float32)
        gpu_runner, _ = make_runner(gpu.model, gpu.config, "flashinfer", 64, BLOCK, "cuda", torch.bfloat16)
        ref = greedy(ref_runner, prompts, NUM_NEW, BLOCK, MAX_LEN)
        out = greedy(gpu_runner, prompts, NUM_NEW, BLOCK, MAX_LEN)
        agree = [sum(a == b for a, b in zip(r, o)) / NUM_NEW for r, o in zip(ref, out)]
        first_div = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, out)]
        lr, lg = first_logits(ref_runner, prompts, BLOCK, MAX_LEN), first_logits(gpu_runner, prompts, BLOCK, MAX_LEN)
        rel = float((lg - lr).norm() / lr.norm())
        forced = forced_agreement(gpu_runner, prompts, ref, BLOCK, MAX_LEN)
        results[fam] = {"token_agreement": agree, "min_agreement": min(agree), "first_divergence": first_div,
                        "teacher_forced_agreement": forced,
                        "step0_logits_rel_norm_diff": rel,
                        "passes": min(agree) >= 0.95 and rel < 2e-2}
        print(fam, results[fam])
    save("gpu_engine_correctness_h100", {"prompt_lengths": [len(p) for p in prompts], "num_new_tokens": NUM_NEW,
                                         "families": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
