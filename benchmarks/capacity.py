"""The most requests per second one GPU could serve a workload at, from the served requests' lengths and the
engine's measured token rate: the ceiling against which the goodput goals of a serving table are read.

Every token of a request, prompt or output, costs at least one dense forward's matmuls (2 x the non-embedding
parameters in FLOPs). The best rate `benchmarks/gpu/engine_speed.py` measured for a large prefill on the whole
GPU (its tokens/s, causal attention included) is taken as the most tokens the GPU turns out per second:

- sustained ceiling = best tokens/s / mean (prompt + output) tokens per request: no rate above it can be served
  for long by any schedule (decode tokens cost at least what prompt tokens cost);
- prefill-only ceiling = best tokens/s / mean prompt tokens (output tokens for free);
- GEMM-peak ceilings: the same at engine_speed's measured bf16 GEMM peak (every FLOP of that prefill, its
  causal attention included, at the peak rate).

A point of a serve_h100 sweep is not a sustained rate: it sends N requests at rate r over N / r seconds and
counts the rate as met when 90% of them attain the SLO, so a backlog that drains after the last arrival still
counts. With a capacity of C req/s and arrivals evenly spaced, the i-th request waits about i (1/C - 1/r)
(first come, first served), so 90% of N meet a TTFT limit T while 0.9 N (1/C - 1/r) <= T. The burst ceiling
is the highest such r, computed here for the prefill-only C (the most generous) and each SLO's TTFT limit.

    python -m benchmarks.capacity benchmarks/results/serve_h100_m2i --speed \\
        benchmarks/results/lease_m2j/gpu_engine_speed_h100.json --out capacity.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from pathlib import Path
from typing import Any

TARGET_ATTAINMENT = 0.9


def request_lengths(runs_dir: Path, system: str | None) -> list[tuple[int, int]]:
    """(prompt, output) tokens requested by every request of one system's runs (all rates): the workload."""
    files = sorted(runs_dir.glob(f"{system}-rate*.json.gz" if system else "*-rate*.json.gz"))
    if not files:
        raise SystemExit(f"no runs in {runs_dir} ({system or 'any system'}-rate*.json.gz)")
    if system is None:  # every system was sent the same requests: one system's runs suffice
        first = files[0].name.split("-rate")[0]
        files = [f for f in files if f.name.split("-rate")[0] == first]
    lengths = []
    for f in files:
        with gzip.open(f, "rt") as fh:
            run = json.load(fh)
        lengths += [(int(r["prompt_tokens_requested"]), int(r["output_tokens_requested"])) for r in run["requests"]]
    return lengths


def token_rates(speed: dict[str, Any]) -> dict[str, float]:
    """The best measured prefill tokens/s on the whole GPU, FLOPs per token behind it, and the GEMM peak."""
    best = max(speed["prefill"].values(), key=lambda p: p["tokens_per_s"])
    flops_per_token = best["tflops"] * 1e12 / best["tokens_per_s"]
    peak = float(speed["peak_gemm_tflops"]) * 1e12
    return {"best_tokens_per_s": float(best["tokens_per_s"]), "best_mfu": float(best["mfu"]),
            "flops_per_token": flops_per_token, "peak_tokens_per_s": peak / flops_per_token}


def burst_ceiling(capacity_rps: float, num_requests: int, ttft_s: float,
                  attainment: float = TARGET_ATTAINMENT) -> float:
    """The highest rate whose burst of num_requests still gets `attainment` of them a first token within ttft_s
    on a server of capacity_rps (inf: any rate)."""
    slack = ttft_s / (attainment * num_requests)  # 1/C - 1/r may be at most this
    inv = 1.0 / capacity_rps - slack
    return math.inf if inv <= 0 else 1.0 / inv


def analyse(result_dir: Path, speed: dict[str, Any], system: str | None = None) -> dict[str, Any]:
    lengths = request_lengths(result_dir / "runs", system)
    prompt = sum(p for p, _ in lengths) / len(lengths)
    output = sum(o for _, o in lengths) / len(lengths)
    rates = token_rates(speed)
    out: dict[str, Any] = {
        "requests": len(lengths), "mean_prompt_tokens": round(prompt, 1), "mean_output_tokens": round(output, 1),
        **{k: round(v, 3 if k == "best_mfu" else 1) for k, v in rates.items()},
        "sustained_ceiling_rps": round(rates["best_tokens_per_s"] / (prompt + output), 2),
        "prefill_only_ceiling_rps": round(rates["best_tokens_per_s"] / prompt, 2),
        "gemm_peak_sustained_ceiling_rps": round(rates["peak_tokens_per_s"] / (prompt + output), 2),
        "gemm_peak_prefill_only_ceiling_rps": round(rates["peak_tokens_per_s"] / prompt, 2),
    }
    compare = json.loads((result_dir / "compare.json").read_text())
    n = int(compare["config"]["workload"]["num_prompts"])
    out["requests_per_rate"] = n
    out["slos"] = {}
    for slo in compare["slos"]:
        if slo.get("ttft_s") is None:
            continue
        name = slo["name"]
        out["slos"][name] = {
            "ttft_s": slo["ttft_s"],
            "burst_ceiling_rps": round(burst_ceiling(out["prefill_only_ceiling_rps"], n, slo["ttft_s"]), 2),
            "gemm_peak_burst_ceiling_rps": round(
                burst_ceiling(out["gemm_peak_prefill_only_ceiling_rps"], n, slo["ttft_s"]), 2),
            # None: the system missed the SLO at the lowest swept rate (its goodput lies below the sweep)
            "goodput_rps": {s: _rounded(v["goodput"][name]["interpolated_rps"])
                            for s, v in compare["systems"].items() if v.get("goodput", {}).get(name)}}
    return out


def _rounded(rps: float | None) -> float | None:
    return None if rps is None else round(rps, 2)


def report(res: dict[str, Any]) -> str:
    lines = [f"{res['requests']} requests: mean prompt {res['mean_prompt_tokens']} tokens, output "
             f"{res['mean_output_tokens']}",
             f"best measured tokens/s on the whole GPU {res['best_tokens_per_s']:.0f} (MFU {res['best_mfu']}), "
             f"at the measured GEMM peak {res['peak_tokens_per_s']:.0f}",
             f"sustained ceiling {res['sustained_ceiling_rps']} req/s (GEMM peak: "
             f"{res['gemm_peak_sustained_ceiling_rps']}); prefill only {res['prefill_only_ceiling_rps']} "
             f"({res['gemm_peak_prefill_only_ceiling_rps']})"]
    for name, s in res["slos"].items():
        goodputs = ", ".join(f"{k} {'below the lowest rate' if v is None else v}" for k, v in s["goodput_rps"].items())
        lines.append(f"{name} (TTFT <= {s['ttft_s'] * 1e3:.0f} ms): burst ceiling of {res['requests_per_rate']} "
                     f"requests {s['burst_ceiling_rps']} req/s (GEMM peak: {s['gemm_peak_burst_ceiling_rps']}); "
                     f"goodput {goodputs}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result_dir", type=Path, help="a serve_h100 result folder (compare.json, runs/)")
    parser.add_argument("--speed", type=Path, required=True, help="benchmarks.gpu.engine_speed's JSON (same GPU)")
    parser.add_argument("--system", default=None, help="whose runs give the request lengths (default: the first)")
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: print only)")
    args = parser.parse_args(argv)
    for path in (args.result_dir / "compare.json", args.speed):
        if not path.is_file():
            parser.error(f"no such file: {path}")
    res = analyse(args.result_dir, json.loads(args.speed.read_text()), args.system)
    print(report(res))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
