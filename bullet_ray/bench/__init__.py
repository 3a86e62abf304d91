"""The serving benchmark (`bullet-ray bench`): a load generator for OpenAI-compatible servers.

Modules: `traces` (workloads: Azure LLM 2023 traces, ShareGPT, random lengths), `serve_bench` (the
streaming client and one run), `slo` (TTFT/TPOT targets, attainment, goodput), `report` (tables and
plots), `compare` (rate sweeps over several systems). The HTTP client (aiohttp) and the plots
(matplotlib) come with the `bench` extra and are imported only when a run needs them, so a base install
still builds the `bullet-ray` parser; `bullet-ray bench` without them says which extra to install.
The repository's `benchmarks/{serve_bench,traces,slo,report,compare}.py` are aliases of these modules.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

BENCH_EXTRA_HINT = "bullet-ray bench needs the bench extra: pip install 'bullet-ray[bench]'"

_DESCRIPTION = ("Send a workload (Azure LLM 2023 traces, ShareGPT, random lengths) to an OpenAI-compatible "
                "server (bullet_ray, vLLM, SGLang) as streaming requests and report TTFT/TPOT/ITL/e2e "
                "percentiles, throughput, SLO attainment; writes JSON, markdown and PNG. Same as "
                "`python -m bullet_ray.bench.serve_bench`.")


class MissingBenchExtra(ImportError):
    """A module of the `bench` extra (aiohttp, matplotlib) is not installed."""

    def __init__(self, module: str) -> None:
        super().__init__(f"{BENCH_EXTRA_HINT} ({module} is not installed)")
        self.module = module


def missing_extras(modules: tuple[str, ...] = ("aiohttp", "matplotlib")) -> list[str]:
    """The modules of the bench extra that cannot be imported here."""
    missing = []
    for module in modules:
        try:
            if importlib.util.find_spec(module) is None:
                missing.append(module)
        except (ImportError, ValueError):  # a broken install, or a module set to None in sys.modules
            missing.append(module)
    return missing


def require_extra(module: str) -> ModuleType:
    """Import a module of the bench extra, or raise MissingBenchExtra naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingBenchExtra(module) from e


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `bench` subcommand with every serve_bench flag (needs no extra)."""
    from bullet_ray.bench import serve_bench

    parser = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (load generator)",
                                   description=_DESCRIPTION)
    serve_bench.add_arguments(parser)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    """Run `bullet-ray bench`; raises MissingBenchExtra before sending anything when the extra is missing."""
    needed = ("aiohttp", "matplotlib") if getattr(args, "plot", True) else ("aiohttp",)
    missing = missing_extras(needed)
    if missing:
        raise MissingBenchExtra(missing[0])
    from bullet_ray.bench import serve_bench

    return int(serve_bench.run_from_args(args))
