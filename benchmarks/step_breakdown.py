"""Where a chunked engine's serving time goes, from its step log and the bench runs served while it was written:
per rate, decode-only vs prefill/mixed device time, the batch-weighted step time against the client's TPOT and
token-weighted time between tokens, the client's TTFT fitted as a fixed part plus a part per prompt token, the
engine's own first-token records (front -> worker, queue, prefill; what the client's TTFT adds to them), and
decode step times by batch size around the decode-graph buckets. `--peers` adds the client-side figures of
other systems' runs (e.g. vllm) at the same rates and, where a run holds vLLM's engine metrics (serve_h100
saves them: benchmarks.vllm_metrics), its engine-side steps; a table then sets per rate our steps (decode /
prompt, tokens per step and per prompt step, steps per token range) beside vLLM's (steps, tokens per step,
steps per token range, preemptions, mean queue / prefill / decode time per request). vLLM counts a prompt's
tokens in the step where its prefill ends, ours in the step that ran them: totals and means compare, a chunked
prompt's ranges do not. Each system's client-side figures also split the gaps between tokens at `--long-gap-ms`
(short: decode-only steps; long: a step that carried prompt tokens), and each peer's requests are paired with ours
(same workload and seed: request i is the same prompt and arrival in both) for the quantiles of its TPOT over
ours; a second table sets both per rate.

    python -m benchmarks.step_breakdown benchmarks/results/serve_h100_m2e/chunked-2048-steps.jsonl.gz \
        --runs benchmarks/results/serve_h100_m2e/runs --system chunked-2048 --rates 8,16,24,32 \
        --out benchmarks/results/serve_h100_m2e/step_breakdown.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.plot_steps import during_run, first_token_parts, records
from benchmarks.rescore import load_run
from benchmarks.vllm_metrics import steps_by_tokens

# gaps between tokens above this are a step that carried prompt tokens (decode-only steps of an 8B model on an H100
# take 7-15 ms; a mixed step with a prompt chunk 15-60 ms)
LONG_GAP_MS = 30.0

# decode batch ranges on both sides of the power-of-two graph bucket boundaries (16 | 32 | 64 | 128 | 256) used
# until the sixth session; kept so that tables before and after the finer buckets compare
BATCH_RANGES = ((13, 16), (17, 20), (29, 32), (33, 36), (57, 64), (65, 72), (120, 128), (129, 140))


def client_side(run: dict, long_gap_ms: float = LONG_GAP_MS) -> dict:
    """What the clients saw at one rate: TPOT p50 (per request), the time between tokens weighted by tokens
    (sum of e2e - TTFT over sum of output tokens - 1: comparable with the engine's batch-weighted step time),
    TTFT p50, (where the requests carry their prompt lengths) TTFT fitted as fixed + per-token time, and (where
    they carry their gaps between tokens) those gaps split at long_gap_ms (`gap_split`)."""
    done = [r for r in run["requests"] if r["success"] and r["output_tokens"] > 1]
    between = sum(r["e2e_s"] - r["ttft_s"] for r in done) / max(1, sum(r["output_tokens"] - 1 for r in done))
    return {"client_tpot_p50_ms": round(run["summary"]["tpot_ms"]["p50"], 1),
            "client_token_weighted_ms": round(between * 1e3, 1),
            "client_ttft_p50_ms": round(run["summary"]["ttft_ms"]["p50"], 1), **ttft_fit(run),
            **gap_split(done, long_gap_ms)}


def gap_split(requests: list[dict], long_gap_ms: float) -> dict:
    """The gaps between streamed tokens of answered requests, split at long_gap_ms: how many are short (a
    decode-only step) and their mean, how many are long (a step that carried prompt tokens) and their sum in
    token-seconds (every running request waits through such a step). Two engines whose short gaps match but
    whose long gaps sum differently differ in their mixed steps. {} when no request carries its gaps (`itl_s`)."""
    gaps = [g * 1e3 for r in requests for g in (r.get("itl_s") or [])]
    if not gaps:
        return {}
    short = [g for g in gaps if g <= long_gap_ms]
    long = [g for g in gaps if g > long_gap_ms]
    return {"gaps_short": len(short), "gap_short_mean_ms": round(statistics.fmean(short), 2) if short else None,
            "gaps_long": len(long), "gaps_long_sum_s": round(sum(long) / 1e3, 2)}


def paired_tpot(ours: dict, peer: dict) -> dict | None:
    """Quantiles (p10 / p50 / p90) of peer TPOT / our TPOT over the requests both answered, paired by index:
    one workload and seed give request i the same prompt, output length and arrival in both runs. None when
    the runs did not send the same requests (prompt or output lengths differ at an index) or none pairs."""
    mine = {r["index"]: r for r in ours["requests"] if r.get("index") is not None}
    ratios = []
    for r in peer["requests"]:
        o = mine.get(r["index"]) if r.get("index") is not None else None
        if o is None:
            continue
        if (o.get("prompt_tokens_requested"), o.get("output_tokens_requested")) != \
                (r.get("prompt_tokens_requested"), r.get("output_tokens_requested")):
            return None
        if o["success"] and r["success"] and o.get("tpot_s") and r.get("tpot_s"):
            ratios.append(r["tpot_s"] / o["tpot_s"])
    if not ratios:
        return None
    q = statistics.quantiles(ratios, n=10, method="inclusive") if len(ratios) > 1 else ratios * 9
    return {"pairs": len(ratios), "tpot_ratio_p10": round(q[0], 3), "tpot_ratio_p50": round(statistics.median(ratios), 3),
            "tpot_ratio_p90": round(q[8], 3)}


def ttft_fit(run: dict) -> dict:
    """Least-squares TTFT = fixed + per_1k x prompt tokens / 1000 over the answered requests: at a light load
    the fixed part is what a request pays whatever its length (the path, waiting for a step), the slope the
    prefill's speed. {} when fewer than 3 requests carry a prompt length, or all have the same."""
    points = [(r["prompt_tokens"], r["ttft_s"] * 1e3) for r in run["requests"]
              if r["success"] and r.get("prompt_tokens") is not None and r.get("ttft_s") is not None]
    if len(points) < 3:
        return {}
    mx = statistics.fmean(x for x, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return {}
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx
    return {"client_ttft_fixed_ms": round(my - slope * mx, 1), "client_ttft_ms_per_1k_prompt": round(slope * 1e3, 1)}


def per_rate(steps: list[dict], run: dict, first_tokens: list[dict] | None = None,
             long_gap_ms: float = LONG_GAP_MS) -> dict:
    window = during_run(steps, run)
    firsts = during_run(first_tokens or [], run)
    decode = [s for s in window if s["phase"] == "decode"]
    prompt = [s for s in window if s["phase"] != "decode"]
    rows = [s["num_seqs"] - s["num_prefill_seqs"] for s in window]
    weighted = sum(r * s["measured_ms"] for r, s in zip(rows, window)) / max(1, sum(rows))
    return {"steps": len(window), "decode_steps": len(decode), "decode_s": round(sum(s["measured_ms"] for s in decode) / 1e3, 2),
            "decode_batch_mean": round(statistics.mean(s["num_seqs"] for s in decode), 1) if decode else None,
            "prompt_steps": len(prompt), "prompt_s": round(sum(s["measured_ms"] for s in prompt) / 1e3, 2),
            "prompt_step_ms_mean": round(statistics.mean(s["measured_ms"] for s in prompt), 1) if prompt else None,
            "tokens_per_step_mean": round(statistics.fmean(s["num_tokens"] for s in window), 1) if window else None,
            "prompt_step_tokens_mean": round(statistics.fmean(s["num_tokens"] for s in prompt), 1) if prompt else None,
            "steps_by_tokens": steps_by_tokens([s["num_tokens"] for s in window]),
            "run_s": round(run["summary"]["duration_s"], 2),
            "ms_per_step": round(run["summary"]["duration_s"] * 1e3 / len(window), 1) if window else None,
            "batch_weighted_step_ms": round(weighted, 1), **client_side(run, long_gap_ms),
            **first_token_parts(firsts, run)}


def vllm_engine_side(run: dict) -> dict | None:
    """vLLM's own view of one rate, as serve_h100 saved it in the run (None: not saved, e.g. older runs):
    steps, tokens per step, steps per token range, preemptions, mean queue / prefill / decode ms per request;
    {"error": ...} where the read failed."""
    found = run.get("probes", {}).get("vllm_metrics")
    if found is None or "error" in found:
        return found
    steps, times = found["steps"] or {}, found["time_ms"]
    num_steps, run_s = steps.get("num_steps"), run["summary"]["duration_s"]
    return {"steps": num_steps, "run_s": round(run_s, 2),
            # an upper bound: vLLM leaves out steps that returned no output (benchmarks.vllm_metrics)
            "ms_per_step": round(run_s * 1e3 / num_steps, 1) if num_steps else None,
            "tokens_per_step_mean": steps.get("tokens_per_step_mean"),
            "steps_by_tokens": steps.get("steps_by_tokens"), "preemptions": found["counters"]["num_preemptions"],
            **{f"{key}_ms_mean": (times[key] or {}).get("mean_ms") for key in ("queue", "prefill", "decode")}}


def _ranges(by_tokens: dict | None) -> str:
    return " ".join(f"{k}:{n}" for k, n in (by_tokens or {}).items() if n) or "-"


def side_by_side(result: dict) -> str:
    """A markdown table per rate: our step log's steps beside each peer's engine-side figures."""
    lines = ["| rate | system | steps | decode / prompt steps | tokens/step | tokens/prompt step | steps by tokens "
             "| preempt. | queue / prefill / decode ms |", "|" + "---|" * 9]
    for rate, ours in result["rates"].items():
        lines.append(f"| {rate} | {result['system']} | {ours['steps']} | {ours['decode_steps']} / "
                     f"{ours['prompt_steps']} | {ours['tokens_per_step_mean']} | {ours['prompt_step_tokens_mean']} "
                     f"| {_ranges(ours['steps_by_tokens'])} | - | - |")
        for peer, by_rate in result.get("peers", {}).items():
            engine = by_rate[rate].get("engine")
            if engine is None:
                continue
            if "error" in engine:
                lines.append(f"| {rate} | {peer} | not read: {engine['error']} |" + " |" * 6)
                continue
            lines.append(f"| {rate} | {peer} | {engine['steps']} | - | {engine['tokens_per_step_mean']} | - "
                         f"| {_ranges(engine['steps_by_tokens'])} | {engine['preemptions']} | "
                         f"{engine['queue_ms_mean']} / {engine['prefill_ms_mean']} / {engine['decode_ms_mean']} |")
    return "\n".join(lines)


def gaps_table(result: dict) -> str:
    """A markdown table per rate: each system's short and long gaps between tokens (`gap_split`) and each peer's
    TPOT over ours, request by request (`paired_tpot`)."""
    lines = ["| rate | system | short gaps: n / mean ms | long gaps: n / sum s | TPOT / ours p10 / p50 / p90 |",
             "|" + "---|" * 5]
    for rate, ours in result["rates"].items():
        rows = [(result["system"], ours, None)] + [(peer, by_rate[rate], by_rate[rate].get("paired"))
                                                   for peer, by_rate in result.get("peers", {}).items()]
        for name, side, paired in rows:
            ratio = "-" if paired is None else \
                f"{paired['tpot_ratio_p10']} / {paired['tpot_ratio_p50']} / {paired['tpot_ratio_p90']}"
            lines.append(f"| {rate} | {name} | {side.get('gaps_short', '-')} / {side.get('gap_short_mean_ms', '-')} "
                         f"| {side.get('gaps_long', '-')} / {side.get('gaps_long_sum_s', '-')} | {ratio} |")
    return "\n".join(lines)


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
    parser.add_argument("--peers", default="",
                        help="other systems in --runs (comma-separated) to report client-side, and engine-side "
                             "where the run holds vLLM's metrics (then a table of both sides is printed too)")
    parser.add_argument("--long-gap-ms", type=float, default=LONG_GAP_MS,
                        help="gaps between tokens above this count as a step that carried prompt tokens")
    parser.add_argument("--out", help="JSON to write")
    args = parser.parse_args(argv)
    recs = records(args.log)
    steps = [r for r in recs if r.get("kind") == "step"]
    first_tokens = [r for r in recs if r.get("kind") == "first_token"]
    result: dict = {"log": args.log, "system": args.system, "rates": {}, "decode_by_batch": by_batch(steps)}
    ours: dict[str, dict] = {}
    for rate in args.rates.split(","):
        path = next(Path(args.runs).glob(f"{args.system}-rate{rate}.json*"))
        ours[rate] = load_run(str(path))
        result["rates"][rate] = per_rate(steps, ours[rate], first_tokens, args.long_gap_ms)
    for peer in filter(None, args.peers.split(",")):
        result.setdefault("peers", {})[peer] = {}
        for rate in args.rates.split(","):
            run = load_run(str(next(Path(args.runs).glob(f"{peer}-rate{rate}.json*"))))
            engine = vllm_engine_side(run)
            paired = paired_tpot(ours[rate], run)
            result["peers"][peer][rate] = {**client_side(run, args.long_gap_ms),
                                           **({"engine": engine} if engine is not None else {}),
                                           **({"paired": paired} if paired is not None else {})}
    text = json.dumps(result, indent=1)
    print(text)
    if any("engine" in by_rate[rate] for by_rate in result.get("peers", {}).values() for rate in by_rate):
        print(side_by_side(result))
    if result.get("peers"):
        print(gaps_table(result))
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
