"""The `bullet-ray` command line: generate text, run the serving benchmark, check the GPU."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bullet_ray.config import SCHEDULES


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text from a prompt with the engine (no Ray)",
                       description="Start an engine (prefill and decode workers), stream one completion "
                                   "to stdout, and stop.")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="a Hugging Face model folder, a .gguf file, dummy:<preset>, or the embedded "
                        "default 'smollm2-135m-instruct' (default)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 = all")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same text)")
    p.add_argument("--schedule", choices=SCHEDULES, default="bullet",
                   help="bullet: prefill and decode workers side by side (default); chunked: one "
                        "hybrid batch per step; static: bullet with a fixed SM split")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--kv-cache-gb", type=float, default=0.25, help="KV pool size in GiB (default 0.25)")


def _generate(args: argparse.Namespace) -> int:
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams
    from bullet_ray.errors import BulletRayError

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        config = EngineConfig(model=args.model, device=args.device, schedule=args.schedule,
                              kv_cache_memory_gb=args.kv_cache_gb)
    except BulletRayError as e:
        print(f"bullet-ray generate: {e}", file=sys.stderr)
        return 2
    print(f"loading {args.model} ...", file=sys.stderr)
    try:
        with LLMEngine(config) as engine:
            prompt = args.prompt
            if args.chat:
                if engine.tokenizer is None:
                    print("bullet-ray generate: --chat needs a model with a tokenizer", file=sys.stderr)
                    return 2
                prompt = engine.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
            for out in engine.stream(prompt, params):
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
                if out.finished and out.error:
                    print(f"\nbullet-ray generate: {out.error}", file=sys.stderr)
                    return 1
            sys.stdout.write("\n")
    except BulletRayError as e:
        print(f"bullet-ray generate: {e}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bullet-ray", description="bullet_ray: LLM serving on Ray Serve "
                                     "with prefill and decode side by side on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    try:
        from bullet_ray.bench import add_bench_parser
    except ImportError:
        add_bench_parser = None  # type: ignore[assignment]
    if add_bench_parser is not None:
        add_bench_parser(sub)
    from bullet_ray.perf import profile_cli

    profile_cli.add_parser(sub)
    doctor = sub.add_parser("doctor", help="report GPU, driver, SM-partition and MPS capabilities",
                            description="Run the SM-partition self-test (python -m bullet_ray.gpu.selftest).")
    doctor.add_argument("--out", default=None, help="write the report as JSON to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "bench":
        from bullet_ray.bench import run_bench

        return int(run_bench(args) or 0)
    if args.command == "profile":
        from bullet_ray.perf import profile_cli

        return profile_cli.run(args)
    if args.command == "doctor":
        from bullet_ray.gpu.selftest import main as selftest_main

        return int(selftest_main(["--out", args.out] if args.out else []) or 0)
    return 2


if __name__ == "__main__":
    sys.exit(main())
