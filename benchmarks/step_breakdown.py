"""Where a chunked engine's serving time goes, from its step log and the bench runs served while it was
written: per rate, decode-only vs prefill/mixed device time, the batch-weighted step time against the
client's TPOT and token-weighted time between tokens, and decode step times by batch size around the
decode-graph buckets. `--peers` adds the client-side figures of other systems' runs (e.g. vllm) at the same
rates.

    python -m benchmarks.step_breakdown benchmarks/results/serve_h100_m2e/chunked-2048-steps.jsonl.gz \
        --runs benchmarks/results/serve_h100_m2e/runs --system chunked-2048 --rates 8,16,24,32 \
        --out benchmarks/results/serve_h100_m2e/step_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.plot_steps import records
from benchmarks.rescore import load_run

# decode batch ranges on both sides of the power-of-two graph bucket boundaries (16 | 32 | 64 | 128 | 256) used
# until the sixth session; kept so that tables before and after the finer buckets compare
BATCH_RANGES = ((13, 16), (17, 20), (29, 32), (33, 36), (57, 64), (65, 72), (120, 128), (129, 140))


def client_side(run: dict) -> dict:
    """What the clients saw at one rate: TPOT p50 (per request), the time between tokens weighted by tokens
    (sum of e2e - TTFT over sum of output tokens - 1: comparable with the engine's batch-weighted step time),
    and TTFT p50."""
    done = [r for r in run["requests"] if r["success"] and r["output_tokens"] > 1]
    between = sum(r["e2e_s"] - r["ttft_s"] for r in done) / max(1, sum(r["output_tokens"] - 1 for r in done))
    return {"client_tpot_p50_ms": round(run["summary"]["tpot_ms"]["p50"], 1),
            "client_token_weighted_ms": round(between * 1e3, 1), "client_ttft_p50_ms": round(run["summary"]["ttft_ms"]["p50"], 1)}


def per_rate(steps: list[dict], run: dict) -> dict:
    t0 = run["environment"]["started_unix_s"]
    window = [s for s in steps if t0 <= s["t"] <= t0 + run["summary"]["duration_s"]]
    decode = [s for s in window if s["phase"] == "decode"]
    prompt = [s for s in window if s["phase"] != "decode"]
    rows = [s["num_seqs"] - s["num_prefill_seqs"] for s in window]
    weighted = sum(r * s["measured_ms"] for r, s in zip(rows, window)) / max(1, sum(rows))
    return {"steps": len(window), "decode_steps": len(decode), "decode_s": round(sum(s["measured_ms"] for s in decode) / 1e3, 2),
            "decode_batch_mean": round(statistics.mean(s["num_seqs"] for s in decode), 1) if decode else None,
            "prompt_steps": len(prompt), "prompt_s": round(sum(s["measured_ms"] for s in prompt) / 1e3, 2),
            "prompt_step_ms_mean": round(statistics.mean(s["measured_ms"] for s in prompt), 1) if prompt else None,
            "batch_weighted_step_ms": round(weighted, 1), **client_side(run)}


def by_batch(steps: list[dict]) -> list[dict]:
    decode = [s for s in steps if s["phase"] == "decode"]
    out = []
    for lo, hi in BATCH_RANGES:
        part = [s for s in decode if lo <= s["num_seqs"] <= hi]
        if part:
            out.append({"seqs": f"{lo}-{hi}", "steps": len(part),
                        "step_ms_p50": round(statistics.median(s["measured_ms"] for s in part), 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the chunked engine's step log (jsonl[.gz])")
    parser.add_argument("--runs", required=True, help="folder of the bench runs (<system>-rate<R>.json[.gz])")
    parser.add_argument("--system", required=True)
    parser.add_argument("--rates", default="8,16,24,32")
    parser.add_argument("--peers", default="", help="other systems in --runs (comma-separated) to report client-side")
    parser.add_argument("--out", help="JSON to write")
    args = parser.parse_args(argv)
    steps = [r for r in records(args.log) if r.get("kind") == "step"]
    result: dict = {"log": args.log, "system": args.system, "rates": {}, "decode_by_batch": by_batch(steps)}
    for rate in args.rates.split(","):
        path = next(Path(args.runs).glob(f"{args.system}-rate{rate}.json*"))
        result["rates"][rate] = per_rate(steps, load_run(str(path)))
    for peer in filter(None, args.peers.split(",")):
        result.setdefault("peers", {})[peer] = {
            rate: client_side(load_run(str(next(Path(args.runs).glob(f"{peer}-rate{rate}.json*")))))
            for rate in args.rates.split(",")}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
