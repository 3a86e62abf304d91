"""CPU throughput of the engine against transformers' `generate` on the embedded SmolLM2-135M-Instruct.

Decode tokens per second at batch 1 and 8 (ignore_eos, fixed output length), for the engine's bullet
(two worker processes) and chunked (one worker) schedules and for Hugging Face `generate` on the same
float32 weights; and, for the two schedules, a mixed batch (`MIXED`: prompts of 200-575 tokens prefilled while
earlier ones decode, the bullet sides stepping at once). Writes a JSON result with device, date and command.

    python -m benchmarks.cpu_vs_transformers --out benchmarks/results/cpu_vs_transformers.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch
from tqdm import tqdm

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MIXED = {"prompts": 16, "first_tokens": 200, "step_tokens": 25, "output_tokens": 48}  # prompt i: 200 + 25 i tokens


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def bench_engine(schedule: str, batch_sizes: list[int], num_tokens: int, repeats: int) -> tuple[dict, str]:
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    results = {}
    with LLMEngine(EngineConfig(schedule=schedule, num_kv_blocks=512)) as engine:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                      add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)
        params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
        engine.generate([prompt], params)  # warm-up
        for bs in batch_sizes:
            times = []
            for _ in tqdm(range(repeats), desc=f"engine {schedule} bs={bs}", file=sys.stderr):
                start = time.perf_counter()
                outs = engine.generate([prompt] * bs, params)
                times.append(time.perf_counter() - start)
                assert all(len(o.token_ids) == num_tokens for o in outs)
            median = statistics.median(times)
            results[f"batch_{bs}"] = {"seconds": median, "tokens_per_s": bs * num_tokens / median,
                                      "runs_s": times}
        text = engine.tokenizer.encode("The history of lighthouses is long and full of stories. " * 60)
        mixed = [text[:MIXED["first_tokens"] + MIXED["step_tokens"] * i] for i in range(MIXED["prompts"])]
        assert len(mixed[-1]) == MIXED["first_tokens"] + MIXED["step_tokens"] * (MIXED["prompts"] - 1), len(text)
        mixed_params = SamplingParams(temperature=0.0, max_tokens=MIXED["output_tokens"], ignore_eos=True)
        times = []
        for _ in tqdm(range(repeats), desc=f"engine {schedule} mixed", file=sys.stderr):
            start = time.perf_counter()
            engine.generate(mixed, mixed_params)
            times.append(time.perf_counter() - start)
        results["mixed"] = {**MIXED, "seconds": statistics.median(times), "runs_s": times}
        folder = engine.handles.tokenizer_path
    return results, folder


def bench_transformers(folder: str, batch_sizes: list[int], num_tokens: int, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                   tokenize=False)
    results = {}
    for bs in batch_sizes:
        enc = tok([text] * bs, return_tensors="pt", padding=True)
        kwargs = dict(max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
                      pad_token_id=tok.pad_token_id or 0)
        model.generate(**enc, **kwargs)  # warm-up
        times = []
        for _ in tqdm(range(repeats), desc=f"transformers bs={bs}", file=sys.stderr):
            start = time.perf_counter()
            model.generate(**enc, **kwargs)
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        results[f"batch_{bs}"] = {"seconds": median, "tokens_per_s": bs * num_tokens / median, "runs_s": times}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-tokens", type=int, default=64, help="generated tokens per request (default 64)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default 1,8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per figure; the median is kept")
    parser.add_argument("--out", default="benchmarks/results/cpu_vs_transformers.json", help="JSON output path")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    bullet, folder = bench_engine("bullet", sizes, args.num_tokens, args.repeats)
    chunked, _ = bench_engine("chunked", sizes, args.num_tokens, args.repeats)
    hf = bench_transformers(folder, sizes, args.num_tokens, args.repeats)
    result = {
        "benchmark": "cpu_vs_transformers",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"CPU: {_cpu_name()}, {os.cpu_count()} cores, torch {torch.__version__} "
                  f"({torch.get_num_threads()} threads)",
        "command": "python -m benchmarks.cpu_vs_transformers " + " ".join(argv if argv is not None else sys.argv[1:]),
        "model": "SmolLM2-135M-Instruct (embedded GGUF, dequantized to float32)",
        "num_tokens": args.num_tokens,
        "engine_bullet": bullet, "engine_chunked": chunked, "transformers_generate": hf,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'system':<24}" + "".join(f"{'bs=' + str(b) + ' tok/s':>16}" for b in sizes))
    for name, res in (("engine (bullet)", bullet), ("engine (chunked)", chunked), ("transformers", hf)):
        print(f"{name:<24}" + "".join(f"{res[f'batch_{b}']['tokens_per_s']:>16.1f}" for b in sizes))
    print(f"mixed batch ({MIXED['prompts']} prompts of {MIXED['first_tokens']}+ tokens x {MIXED['output_tokens']} out): "
          f"bullet {bullet['mixed']['seconds']:.2f} s, chunked {chunked['mixed']['seconds']:.2f} s")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
