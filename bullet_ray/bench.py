"""`bullet-ray bench`: the serving load generator (benchmarks/serve_bench.py) as a CLI subcommand.

The benchmark code lives in the repository's top-level `benchmarks` package so it runs unchanged against
any OpenAI-compatible server; this module only exposes it to the `bullet-ray` command. From a source
checkout the package is found next to `bullet_ray/`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

_DESCRIPTION = ("Send a workload (Azure LLM 2023 traces, ShareGPT, random lengths) to an OpenAI-compatible "
                "server (bullet_ray, vLLM, SGLang) as streaming requests and report TTFT/TPOT/ITL/e2e "
                "percentiles, throughput, SLO attainment; writes JSON, markdown and PNG. Same as "
                "`python -m benchmarks.serve_bench`.")


def _serve_bench() -> ModuleType:
    if importlib.util.find_spec("benchmarks") is None:
        repo = Path(__file__).resolve().parent.parent
        if (repo / "benchmarks" / "serve_bench.py").is_file():
            sys.path.insert(0, str(repo))
    try:
        from benchmarks import serve_bench
    except ImportError as e:
        raise SystemExit(f"bullet-ray bench needs the repository's benchmarks/ package (a source checkout): {e}") from e
    return serve_bench


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand with every serve_bench flag."""
    parser = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (load generator)",
                                   description=_DESCRIPTION)
    _serve_bench().add_arguments(parser)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    return int(_serve_bench().run_from_args(args))
