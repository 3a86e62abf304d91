"""The `bullet-ray` command line: generate text, run the serving benchmark, check the GPU.

Each subcommand is one `_add_<name>(subparsers)` that registers its flags and sets `run=<function>`;
`main` calls `args.run(args)`. A base install (no extras) runs every subcommand but `bench`, which needs
the `bench` extra and says so. Bad arguments end with one line on stderr naming the flag
("bullet-ray generate: error: --model: ...") and exit code 2; BULLET_RAY_DEBUG=1 also prints the traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from bullet_ray.config import SCHEDULES
from bullet_ray.errors import BulletRayError, ConfigError, InvalidSamplingParams, ModelLoadError

logger = logging.getLogger(__name__)

EXIT_USAGE = 2  # bad argument or missing extra
EXIT_FAILED = 1  # the command ran and failed


class UsageError(Exception):
    """A bad command-line value. `flag` names it (e.g. "--model")."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line ("<prog>: error: --flag: message"), without the usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message.removeprefix('argument ')}\n")


def _is_debug() -> bool:
    return os.environ.get("BULLET_RAY_DEBUG", "") not in ("", "0")


def _one_line(e: BaseException) -> str:
    """The error as one line: a multi-line message (a worker's traceback) keeps its first and last lines."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')}: {lines[-1]}"


# ------------------------------------------------------------------------------------------- generate

_ENGINE_FIELD_FLAGS = {"model": "--model", "device": "--device", "schedule": "--schedule",
                       "kv_cache_memory_gb": "--kv-cache-gb", "temperature": "--temperature", "top_p": "--top-p",
                       "top_k": "--top-k", "seed": "--seed", "max_tokens": "--max-tokens"}


def _flag(field: str) -> str:
    return _ENGINE_FIELD_FLAGS.get(field, field)


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
    p.set_defaults(run=_generate)


def check_model(model: str) -> None:
    """Fail fast, before any worker starts, when `model` cannot be found; raises UsageError("--model")."""
    from bullet_ray.models import loader

    try:
        if model.lower() in loader.EMBEDDED_NAMES:
            loader.embedded_gguf_path()  # the embedded model's package is installed (no conversion here)
        else:
            loader.resolve_source(model)
    except ModelLoadError as e:
        raise UsageError("--model", str(e)) from e


def _generate(args: argparse.Namespace) -> int:
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.sampling_params import SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                seed=args.seed, max_tokens=args.max_tokens)
        config = EngineConfig(model=args.model, device=args.device, schedule=args.schedule,
                              kv_cache_memory_gb=args.kv_cache_gb)
    except (ConfigError, InvalidSamplingParams) as e:
        raise UsageError(_flag(e.field), str(e).removeprefix(f"{e.field}: ")) from e
    check_model(args.model)
    from bullet_ray.engine.llm_engine import LLMEngine

    print(f"loading {args.model} ...", file=sys.stderr)
    with LLMEngine(config) as engine:
        prompt = args.prompt
        if args.chat:
            if engine.tokenizer is None:
                raise UsageError("--chat", f"model {args.model!r} has no tokenizer (so no chat template)")
            prompt = engine.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        for out in engine.stream(prompt, params):
            sys.stdout.write(out.text_delta)
            sys.stdout.flush()
            if out.finished and out.error:
                print(f"\n{args.prog}: error: {_one_line(RuntimeError(out.error))}", file=sys.stderr)
                return EXIT_FAILED
        sys.stdout.write("\n")
    return 0


# ---------------------------------------------------------------------------------------------- bench

def _add_bench(sub: argparse._SubParsersAction) -> None:
    from bullet_ray.bench import add_bench_parser

    add_bench_parser(sub).set_defaults(run=_bench)


def _bench(args: argparse.Namespace) -> int:
    import json

    from bullet_ray.bench import missing_extras, run_bench

    try:
        extra_body = json.loads(args.extra_body)
    except ValueError as e:
        raise UsageError("--extra-body", f"not JSON: {e}") from e
    if not isinstance(extra_body, dict):
        raise UsageError("--extra-body", f"must be a JSON object, got {args.extra_body!r}")
    if missing_extras(("aiohttp",)):
        return run_bench(args)  # raises MissingBenchExtra
    import aiohttp

    try:
        return run_bench(args)
    except (aiohttp.ClientConnectionError, OSError) as e:
        raise UsageError("--base-url", f"cannot reach {args.base_url}: {e}") from e


# --------------------------------------------------------------------------------------------- doctor

def _add_doctor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="report GPU, driver, SM-partition and MPS capabilities, and libcublasLt",
                       description="Run the SM-partition self-test (python -m bullet_ray.gpu.selftest).")
    p.add_argument("--out", default=None, help="write the report as JSON to this file")
    p.set_defaults(run=_doctor)


def _doctor(args: argparse.Namespace) -> int:
    from bullet_ray.gpu.selftest import main as selftest_main
    from bullet_ray.gpu.smctl import SmctlError

    try:
        return int(selftest_main(["--out", args.out] if args.out else []) or 0)
    except SmctlError as e:  # e.g. the native helper cannot be built here (no C compiler)
        print(f"{args.prog}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_FAILED


# -------------------------------------------------------------------------------------------- profile

def _add_profile(sub: argparse._SubParsersAction) -> None:
    from bullet_ray.perf import profile_cli  # the sweep itself imports torch only when it runs

    profile_cli.add_parser(sub).set_defaults(run=profile_cli.run)


# ----------------------------------------------------------------------------------------------- main

# one entry per subcommand: a function that adds its parser (with `run` as a default)
SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_generate, _add_bench, _add_profile,
                                                                   _add_doctor]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="bullet-ray", description="bullet_ray: LLM serving on Ray Serve with prefill and "
                                                    "decode side by side on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _fail(prog: str, message: str, code: int) -> int:
    if _is_debug():
        traceback.print_exc()
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.prog = f"bullet-ray {args.command}"
    from bullet_ray.bench import MissingBenchExtra

    try:
        return int(args.run(args) or 0)
    except UsageError as e:
        return _fail(args.prog, str(e), EXIT_USAGE)
    except MissingBenchExtra as e:  # the one line says which extra to install
        print(str(e), file=sys.stderr)
        return EXIT_USAGE
    except BulletRayError as e:
        return _fail(args.prog, _one_line(e), EXIT_FAILED)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
