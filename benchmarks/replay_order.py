"""Replay one served run's arrivals through a model of the prefill queue, to estimate what a TTFT planning margin
(EngineConfig.ttft_margin_ms) does to TTFT attainment. A model, not a GPU measurement.

What it models:
- arrivals and prompt lengths of one run (`scheduled_s`, `prompt_tokens` of a serve_bench run file); each request
  reaches the prefill queue `overhead_ms` / 2 after it is sent and its first token reaches the client
  `overhead_ms` / 2 after its prefill ends (the time outside the workers: HTTP, Serve, the engine front);
- one prefill side that runs one batch after another at a fixed prompt-token rate (by default the median rate of
  the run's prefill steps of >= 1,500 tokens on 116 SMs, from its step log), a batch taking the queue in order up to
  `cap_tokens` (a longer prompt in chunks; a started prompt stays first, as the scheduler does) and only while
  the batch's first request still meets its (planned) target, unless it cannot anyway (BulletPolicy.plan's fit);
- at every step boundary the queue ordered by the policy's own `least_slack_order` (bullet_ray.policy.ordering),
  its prefill time predicted without error (tokens / rate) and its TTFT target shortened by the margin
  (SloTargets.margin_s);
- each step's real time = predicted x lognormal noise (median 1), its sigma such that the p90 of |error| is the
  step log's measured p90 prefill error (|predicted - measured| / measured over every prefill step).

What it leaves out: the decode side (its SMs: prefill here always runs at the 116-SM rate, while the real split
gives prefill fewer SMs when decode is busy, and the split rule that moves it), a step's fixed cost (small steps
are as efficient as large ones here), the length buckets and saturation size of the real batch planner, planning
the next batch while the step in flight runs (an arrival here joins the next step boundary), TPOT, and errors
that persist over many steps (the noise here is independent per step). Attainment here is TTFT <= target only.

    python -m benchmarks.replay_order                              # the H200 m2z run at 32 req/s
    python -m benchmarks.replay_order --margins 0,25,50 --seeds 10 --json out.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bullet_ray.policy.ordering import least_slack_order
from bullet_ray.policy.slo import SloTargets
from bullet_ray.policy.state import QueuedRequest

RESULTS = Path(__file__).resolve().parent / "results" / "serve_h200_m2z"
RUN = RESULTS / "runs" / "bullet-slo+direct-rate32.json.gz"
STEPS = RESULTS / "bullet-slo+direct-steps.jsonl.gz"
Z90 = 1.6448536269514722  # the standard normal's 95th percentile: P(|Z| <= Z90) = 0.9


@dataclass(frozen=True)
class Arrival:
    request_id: str
    scheduled_s: float  # when the client sent it, from the run's start
    num_prompt_tokens: int


@dataclass(frozen=True)
class StepRate:
    tokens_per_s: float  # median prompt tokens per second of the chosen steps
    num_steps: int  # steps the median is over
    p90_error: float  # p90 of |predicted - measured| / measured over every prefill step


def _open(path: Path):
    return gzip.open(path, "rt") if path.suffix == ".gz" else path.open()


def load_run(path: Path) -> tuple[list[Arrival], list[float | None]]:
    """Arrivals (in send order) and the measured client TTFTs (None: failed) of a serve_bench run file."""
    with _open(path) as f:
        records = json.load(f)["requests"]
    records = sorted(records, key=lambda r: r["scheduled_s"])
    arrivals = [Arrival(str(r["index"]), float(r["scheduled_s"]), int(r["prompt_tokens"] or r["prompt_tokens_requested"]))
                for r in records]
    ttfts = [r["ttft_s"] if r.get("success") else None for r in records]
    return arrivals, ttfts


def load_step_rate(path: Path, min_tokens: int = 1500, prefill_sms: int = 116) -> StepRate:
    """The prefill side's token rate and prediction error from a step log (EngineConfig.step_log_path)."""
    steps = []
    with _open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "step" and rec.get("side") == "prefill" and rec.get("phase") == "prefill" \
                    and rec.get("measured_ms", 0) > 0:
                steps.append(rec)
    big = [s for s in steps if s["num_tokens"] >= min_tokens and s["prefill_sms"] == prefill_sms]
    if not big:
        raise SystemExit(f"{path}: no prefill step of >= {min_tokens} tokens on {prefill_sms} SMs")
    errors = [abs(s["predicted_ms"] - s["measured_ms"]) / s["measured_ms"] for s in steps]
    p90 = statistics.quantiles(errors, n=10)[-1] if len(errors) > 1 else errors[0]
    return StepRate(statistics.median(s["num_tokens"] / s["measured_ms"] * 1e3 for s in big), len(big), p90)


def sigma_for_p90_error(p90_error: float) -> float:
    """Sigma of a lognormal factor whose |log| has its p90 at log(1 + p90_error)."""
    return math.log1p(p90_error) / Z90


def replay(arrivals: Sequence[Arrival], tokens_per_s: float, targets: SloTargets, cap_tokens: int = 8192,
           noise_sigma: float = 0.0, overhead_s: float = 0.0, rng: random.Random | None = None) -> list[float]:
    """Client TTFTs (s, in `arrivals`' order) of one replay: see the module docstring."""
    rng = rng or random.Random(0)
    half = overhead_s / 2
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i].scheduled_s)
    enters = {i: arrivals[i].scheduled_s + half for i in pending}
    computed: dict[str, int] = {}  # queued request id -> prompt tokens prefilled so far
    index_of = {a.request_id: i for i, a in enumerate(arrivals)}
    ttft = [math.nan] * len(arrivals)
    now, nxt = 0.0, 0

    def own_s(r: QueuedRequest) -> float:
        return r.num_remaining_tokens / tokens_per_s

    while nxt < len(pending) or computed:
        if not computed:
            now = max(now, enters[pending[nxt]])
        while nxt < len(pending) and enters[pending[nxt]] <= now:
            computed[arrivals[pending[nxt]].request_id] = 0
            nxt += 1
        queue = [QueuedRequest(rid, arrivals[index_of[rid]].num_prompt_tokens, now - enters[index_of[rid]], done)
                 for rid, done in computed.items()]
        order = least_slack_order(queue, own_s, targets)
        head, head_target = order[0], targets.ttft_target_s(order[0].num_prompt_tokens)
        batch: list[tuple[str, int]] = []
        used = 0
        for r in order:  # BulletPolicy.plan's fit: the batch grows while its head still makes its target
            take = min(r.num_remaining_tokens, cap_tokens - used)
            late = head.waited_s + (used + take) / tokens_per_s > head_target
            if take <= 0 or (batch and late and head.waited_s + own_s(head) <= head_target):
                break
            batch.append((r.request_id, take))
            used += take
        now += used / tokens_per_s * (math.exp(rng.gauss(0.0, noise_sigma)) if noise_sigma else 1.0)
        for rid, take in batch:
            computed[rid] += take
            i = index_of[rid]
            if computed[rid] >= arrivals[i].num_prompt_tokens:
                del computed[rid]
                ttft[i] = now + half - arrivals[i].scheduled_s
    return ttft


def attainment(ttfts: Sequence[float | None], target_s: float) -> float:
    return sum(t is not None and t <= target_s for t in ttfts) / len(ttfts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=RUN, help="serve_bench run file (.json or .json.gz)")
    parser.add_argument("--steps", type=Path, default=STEPS, help="step log of the same system (.jsonl or .jsonl.gz)")
    parser.add_argument("--margins", default="0,10,25,50,75,100", help="comma-separated TTFT margins (ms)")
    parser.add_argument("--seeds", type=int, default=20, help="noise seeds per margin (averaged)")
    parser.add_argument("--ttft-ms", type=float, default=500.0, help="TTFT target (ms)")
    parser.add_argument("--overhead-ms", type=float, default=14.0, help="time outside the workers (ms), half each way")
    parser.add_argument("--cap-tokens", type=int, default=8192, help="token budget of one prefill batch")
    parser.add_argument("--tokens-per-s", type=float, default=None,
                        help="prefill rate (prompt tokens/s); default: the step log's median on --sms SMs")
    parser.add_argument("--sms", type=int, default=116, help="prefill SMs of the steps the rate is taken from")
    parser.add_argument("--p90-error", type=float, default=None,
                        help="p90 of the step-time error the noise reproduces; default: the step log's")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    arrivals, measured = load_run(args.run)
    rate = load_step_rate(args.steps, prefill_sms=args.sms)
    tokens_per_s = args.tokens_per_s or rate.tokens_per_s
    p90 = rate.p90_error if args.p90_error is None else args.p90_error
    sigma = sigma_for_p90_error(p90)
    target_s = args.ttft_ms / 1e3
    margins = [float(m) for m in args.margins.split(",")]
    print(f"run {args.run.name}: {len(arrivals)} requests over {arrivals[-1].scheduled_s:.2f} s, "
          f"{sum(a.num_prompt_tokens for a in arrivals)} prompt tokens; measured TTFT <= {args.ttft_ms:g} ms: "
          f"{attainment(measured, target_s):.1%}, TTFT p50 "
          f"{statistics.median(t for t in measured if t is not None) * 1e3:.0f} ms")
    print(f"prefill rate {tokens_per_s:,.0f} tokens/s (step log: median of {rate.num_steps} steps on {args.sms} SMs "
          f"{rate.tokens_per_s:,.0f}), step noise lognormal sigma {sigma:.4f} (p90 error {p90:.1%}), overhead "
          f"{args.overhead_ms:g} ms, batch cap {args.cap_tokens} tokens, {args.seeds} seeds")
    rows = []
    print(f"{'margin_ms':>9} {'no_noise':>9} {'mean':>7} {'min':>7} {'max':>7} {'miss_<=10ms':>11} {'p50_ms':>7}")
    for margin in margins:
        targets = SloTargets(target_s, margin_s=margin / 1e3)
        clean = attainment(replay(arrivals, tokens_per_s, targets, args.cap_tokens, 0.0, args.overhead_ms / 1e3),
                           target_s)
        shares, near, p50s = [], [], []
        for seed in range(args.seeds):
            ttfts = replay(arrivals, tokens_per_s, targets, args.cap_tokens, sigma, args.overhead_ms / 1e3,
                           random.Random(seed))
            shares.append(attainment(ttfts, target_s))
            near.append(sum(target_s < t <= target_s + 0.01 for t in ttfts))
            p50s.append(statistics.median(ttfts))
        row = {"margin_ms": margin, "no_noise": clean, "mean": statistics.fmean(shares), "min": min(shares),
               "max": max(shares), "mean_misses_within_10ms": statistics.fmean(near), "mean_p50_ms": statistics.fmean(p50s) * 1e3}
        rows.append(row)
        print(f"{margin:>9g} {clean:>9.1%} {row['mean']:>7.1%} {row['min']:>7.1%} {row['max']:>7.1%} "
              f"{row['mean_misses_within_10ms']:>11.1f} {row['mean_p50_ms']:>7.0f}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "run": str(args.run), "steps": str(args.steps), "measured_attainment": attainment(measured, target_s),
            "tokens_per_s": tokens_per_s, "noise_sigma": sigma, "p90_error": p90, "overhead_ms": args.overhead_ms,
            "cap_tokens": args.cap_tokens, "ttft_ms": args.ttft_ms, "seeds": args.seeds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
