"""Replay one served run through a model of BOTH sides of the bullet schedule and the real split rule, to predict
what a TTFT planning margin (EngineConfig.ttft_margin_ms) and its scope (ttft_margin_scope) do to strict SLO
attainment, TTFT and TPOT. A discrete-event MODEL calibrated on a step log, not a GPU measurement.

What it models:
- the run's arrivals, prompt and output lengths (`scheduled_s`, `prompt_tokens`, `output_tokens_requested`: the
  bench ran with ignore_eos); a request reaches the prefill queue `overhead_ms` / 2 after it is sent, and each of
  its tokens reaches the client `overhead_ms` / 2 after the step that made it ends;
- step times fitted to the same system's step log by least squares, per (SMs, other side busy): prefill = fixed
  + per token + per attention pair, decode = fixed + per sequence + per context token; an entry with fewer than
  `MIN_FIT_STEPS` steps takes the nearest fitted entry's time scaled by the profile's roofline ratio between the
  two (PerfModel without correction). A simulated step takes the fitted time x lognormal noise (median 1, the p90
  of |log| at the log's p90 prediction error of that side, as benchmarks.replay_order does);
- the real policy: BulletPolicy (order, batches, SplitRule) with EngineConfig's planning_targets / split_targets /
  split_settings, the deployment's token cap, the default ladder on 132 SMs, and the profile's PerfModel whose
  online correction first learns the log's steps from before the run (the earlier rates the server served;
  `--no-warm`: none), then each simulated prefill step and, at each decision, decode's last step (as
  policy_link.StepRecorder and SplitDecider._observe_decode feed it);
- the engine's timing: prefill plans (and decides the split) as its step before launches, or when a request
  reaches an idle empty side; while prefill idles, a decision at each decode step; a requested split applies to
  each side at its next launch; decode steps while it has sequences; a prefilled sequence joins decode at decode's
  first step boundary `relay_ms` after its prefill step ends, and every decode step gives each running sequence
  one token. TPOT = (last token - first token) / (output tokens - 1).

What it leaves out: the front -> worker wait and the pipe reads (only `overhead_ms`), the mixed fallback and
admission (off in the H200 runs), the SM sharing while a switch drains (a step runs wholly on the entry it
launched on), the KV pool, the decode side's launch-ahead, and errors that persist over steps (noise is
independent per step).

Against the six H200 margin runs (benchmarks/results/replay_split_h200/README.md) it matches 32 req/s and does NOT
reproduce the TPOT collapse measured at 40 req/s with margins 25 / 50.

    python -m benchmarks.replay_split --run benchmarks/results/serve_h200_m3a/runs/bullet-slo+direct-rate40.json.gz \
        --margins 0,50 --scopes all,order --seeds 5 --json out.json
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.plot_steps import records, run_start_unix_s
from benchmarks.replay_order import sigma_for_p90_error
from benchmarks.rescore import load_run as load_bench_run
from benchmarks.rescore import miss_kinds
from bullet_ray.bench.slo import PRESETS, attainment
from bullet_ray.config import EngineConfig
from bullet_ray.gpu.partition import default_ladder
from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.model import PerfModel
from bullet_ray.policy.bullet import BulletPolicy
from bullet_ray.policy.state import DecodeLoad, QueuedRequest, StepState

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "serve_h200_m3a"
RUN = RESULTS / "runs" / "bullet-slo+direct-rate40.json.gz"
SCOPES = ("all", "order")
COLLAPSE_TPOT_MISSES = 20  # a seed with this many TPOT-only misses counts as a TPOT collapse (the run: 45-48)
SM_COUNT = 132
MIN_FIT_STEPS = 20  # steps a (SMs, other busy) entry needs for its own least-squares fit
MAX_FIT_ERROR = 0.2  # an entry whose own fit misses its median step by more takes a neighbour's, scaled
TRIM_SHARE, TRIM_ROUNDS = 0.1, 2  # the fit leaves out its worst-fitted 10% of steps, twice
PROFILE_MODEL = "llama-3.1-8b"
PROFILE_DEVICE = "NVIDIA H200"


@dataclass(frozen=True)
class Request:
    request_id: str
    scheduled_s: float  # when the client sent it, from the run's start
    num_prompt_tokens: int
    num_output_tokens: int  # the first token (from prefill) included


def load_requests(path: Path) -> tuple[list[Request], list[Any]]:
    """The run's requests in send order, and its measured records for bullet_ray.bench.slo / rescore.miss_kinds."""
    rows = sorted(load_bench_run(path)["requests"], key=lambda r: r["scheduled_s"])
    reqs = [Request(str(r["index"]), float(r["scheduled_s"]), int(r.get("prompt_tokens") or r["prompt_tokens_requested"]),
                    int(r.get("output_tokens_requested") or len(r.get("itl_s") or []) + 1)) for r in rows]
    measured = [SimpleNamespace(success=r["success"], ttft_s=r["ttft_s"], tpot_s=r["tpot_s"],
                                prompt_tokens=r["prompt_tokens"]) for r in rows]
    return reqs, measured


# step-time fits ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearFit:
    coef: tuple[float, float, float]  # fixed s, then per feature (prefill: token, pair; decode: sequence, context)
    num_steps: int
    median_error: float  # of |fit - measured| / measured over its steps
    p90_error: float


def features(shape: StepShape) -> tuple[float, float, float]:
    if shape.phase == "prefill":
        return 1.0, float(shape.num_tokens), float(shape.num_attention_pairs)
    return 1.0, float(shape.num_seqs), float(shape.num_context_tokens)


def shape_of_record(r: dict) -> StepShape:
    if r["phase"] == "prefill":
        return StepShape("prefill", r["num_tokens"], r["num_seqs"], r["num_context_tokens"], r["num_attention_pairs"])
    return StepShape.decode(r["num_seqs"], r["num_context_tokens"])


def fit_linear(rows: list[dict]) -> LinearFit:
    """Least squares measured = c0 + c1 x1 + c2 x2 (features of `shape_of_record`), coefficients kept >= 0; the
    TRIM_SHARE of steps worst fitted are left out, TRIM_ROUNDS times, before the last fit."""
    import numpy as np

    x = np.array([features(shape_of_record(r)) for r in rows])
    y = np.array([r["measured_ms"] / 1e3 for r in rows])
    keep = np.ones(len(y), dtype=bool)
    for _ in range(TRIM_ROUNDS):  # refit without the steps the fit before misses by most (warm-up, stalls)
        coef = np.clip(np.linalg.lstsq(x[keep], y[keep], rcond=None)[0], 0.0, None)
        err = np.abs(x @ coef - y) / y
        keep = err <= np.quantile(err, 1 - TRIM_SHARE)
    coef = np.clip(np.linalg.lstsq(x[keep], y[keep], rcond=None)[0], 0.0, None)
    err = np.abs(x @ coef - y) / y  # over every step, the trimmed ones too
    return LinearFit((float(coef[0]), float(coef[1]), float(coef[2])), len(rows), float(np.median(err)),
                     float(np.quantile(err, 0.9)))


@dataclass
class StepModel:
    """The simulated 'real' step time: the log's fits per (phase, SMs, other busy), scaled for the others."""
    fits: dict[tuple[str, int, bool], LinearFit]
    roofline: PerfModel  # the profile without online correction: the scaling between entries
    sigma: dict[str, float]  # lognormal noise per phase
    p90_log_error: dict[str, float]  # the step log's p90 |predicted - measured| / measured per phase

    def seconds(self, shape: StepShape, sms: int, other_busy: bool) -> float:
        key: tuple[str, int, bool] = (shape.phase, sms, other_busy)
        fit = self.fits.get(key)
        if fit is None:
            near = [k for k in self.fits if k[0] == shape.phase]
            key = min(near, key=lambda k: (k[2] != other_busy, abs(k[1] - sms)))
            fit = self.fits[key]
        t = sum(c * f for c, f in zip(fit.coef, features(shape)))
        if key[1:] != (sms, other_busy):
            t *= self.roofline.predict(shape, sms, other_busy).calibrated_s / \
                self.roofline.predict(shape, key[1], key[2]).calibrated_s
        return max(t, 1e-4)

    def noisy_seconds(self, shape: StepShape, sms: int, other_busy: bool, rng: random.Random | None) -> float:
        t = self.seconds(shape, sms, other_busy)
        sigma = self.sigma[shape.phase]
        return t * math.exp(rng.gauss(0.0, sigma)) if rng is not None and sigma > 0 else t


def fit_step_model(log_records: list[dict], roofline: PerfModel) -> StepModel:
    """Fits per (phase, SMs, other busy) over the log's steps (not across a switch, not mixed; entries with
    MIN_FIT_STEPS steps whose fit's median error is at most MAX_FIT_ERROR); raises
    ValueError when a phase has no entry with MIN_FIT_STEPS steps."""
    groups: dict[tuple[str, int, bool], list[dict]] = {}
    errors: dict[str, list[float]] = {"prefill": [], "decode": []}
    for r in log_records:
        if r.get("kind") != "step" or r.get("phase") not in ("prefill", "decode") or not r.get("measured_ms", 0) > 0:
            continue
        errors[r["phase"]].append(abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"])
        if r.get("across_switch"):
            continue
        sms = r["prefill_sms"] if r["phase"] == "prefill" else r["decode_sms"]
        groups.setdefault((r["phase"], sms, bool(r["other_busy"])), []).append(r)
    fits = {k: fit_linear(rows) for k, rows in groups.items() if len(rows) >= MIN_FIT_STEPS}
    fits = {k: fit for k, fit in fits.items() if fit.median_error <= MAX_FIT_ERROR}  # else scaled from a neighbour
    for phase in ("prefill", "decode"):
        if not any(k[0] == phase for k in fits):
            raise ValueError(f"the step log has no {phase} entry with >= {MIN_FIT_STEPS} steps to fit")
    p90 = {p: statistics.quantiles(e, n=10)[-1] if len(e) > 1 else 0.0 for p, e in errors.items()}
    return StepModel(fits, roofline, {p: sigma_for_p90_error(v) for p, v in p90.items()}, p90)


# the replay ---------------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    ttft_s: list[float | None]  # client TTFT per request (None: never served)
    tpot_s: list[float | None]  # None: one output token
    num_tokens: list[int]  # output tokens each request got
    decisions: Counter = field(default_factory=Counter)  # split decisions by reason
    decode_sms_s: dict[int, float] = field(default_factory=dict)  # decode step seconds by decode SMs
    max_decode_seqs: int = 0
    model_errors: dict[str, list[float]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    # in order: ("prefill" | "decode", launch time, ladder entry it runs on) and ("request", decision time, entry
    # requested) for each decision that changed the requested entry
    timeline: list[tuple[str, float, int]] = field(default_factory=list)


@dataclass
class _Seq:
    index: int  # the request's position
    context: int  # KV tokens
    tokens: int  # output tokens so far
    ready_s: float = 0.0  # when it may join decode


def warm_up(model: PerfModel, log_steps: Sequence[dict]) -> None:
    """Feed logged steps (`steps_before`) to the model's online correction, as the served engine had learned
    them before the run began."""
    for r in log_steps:
        sms = r["prefill_sms"] if r["phase"] == "prefill" else r["decode_sms"]
        model.observe(shape_of_record(r), sms, bool(r["other_busy"]), r["split_index"], r["measured_ms"] / 1e3)


def steps_before(log_records: list[dict], start_unix_s: float) -> list[dict]:
    """The log's steps learned from before `start_unix_s` (the run's start): the earlier rates' served steps."""
    return [r for r in log_records if r.get("kind") == "step" and r.get("t", math.inf) < start_unix_s
            and not r.get("across_switch")
            and r.get("phase") in ("prefill", "decode") and r.get("measured_ms", 0) > 0]


def replay(reqs: Sequence[Request], steps: StepModel, policy: BulletPolicy, rng: random.Random | None = None,
           overhead_s: float = 0.014, relay_s: float = 0.001, warm: Sequence[dict] = ()) -> Outcome:
    """One replay (see the module docstring); `policy` is fresh (its model's online correction starts empty, then
    learns the steps `warm`); `rng` None: no noise."""
    half = overhead_s / 2
    model = policy.model
    warm_up(model, warm)
    rule = policy.rule
    n = len(reqs)
    out = Outcome([None] * n, [None] * n, [0] * n)
    first: list[float] = [math.nan] * n
    by_id = {r.request_id: i for i, r in enumerate(reqs)}
    events: list[tuple[float, int, str, Any]] = []
    counter = 0

    def push(t: float, kind: str, payload: Any = None) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    for i, r in enumerate(reqs):
        push(r.scheduled_s + half, "arrive", i)
    requested = 0  # the ladder entry both sides launch on next
    computed: dict[int, int] = {}  # queued request -> prompt tokens in batches so far
    entered: dict[int, float] = {}
    planned: list[tuple[int, int]] | None = None  # (request, tokens) of the next prefill launch
    p_inflight: dict[str, Any] | None = None  # the prefill step running
    running: list[_Seq] = []  # decode batch
    waiting: list[_Seq] = []  # handed off, not yet in a decode step
    d_inflight: dict[str, Any] | None = None
    last_decode: tuple[StepShape, int, bool, int, float] | None = None  # for the next decision's observe
    last_decode_s: float | None = None

    def prefill_shape(batch: list[tuple[int, int]]) -> StepShape:
        return StepShape.of_prompts([take + computed[i] for i, take in batch], [computed[i] for i, _ in batch])

    def decide(now: float) -> None:
        nonlocal planned, requested, last_decode
        if last_decode is not None:  # SplitDecider._observe_decode: decode's last step since the decision before
            shape, sms, busy, index, measured = last_decode
            model.observe(shape, sms, busy, index, measured)
            last_decode = None
        queue = tuple(QueuedRequest(reqs[i].request_id, reqs[i].num_prompt_tokens, now - entered[i], done)
                      for i, done in computed.items() if done < reqs[i].num_prompt_tokens
                      and not (planned and any(j == i for j, _ in planned)))
        incoming = p_inflight["done"] if p_inflight else []
        seqs = running + waiting
        num_seqs = len(seqs) + len(incoming)
        ctx = sum(s.context for s in seqs) + sum(reqs[i].num_prompt_tokens + 1 for i in incoming)
        remaining = max(0.0, p_inflight["predicted_end"] - now) if p_inflight else 0.0
        state = StepState(requested, queue, DecodeLoad(num_seqs, ctx, last_decode_s if running else None), now,
                          remaining)
        result = policy.step(state)
        out.decisions[result.split.reason.value] += 1
        if result.split.index != requested:
            out.timeline.append(("request", now, result.split.index))
        requested = result.split.index
        if result.batches and planned is None:
            cap, used, batch = policy.token_cap, 0, []
            for q in result.batches[0]:
                take = min(q.num_remaining_tokens, cap - used)
                if take <= 0:
                    break
                batch.append((by_id[q.request_id], take))
                used += take
            planned = batch
            if p_inflight is None:
                launch_prefill(now)

    def launch_prefill(now: float) -> None:
        nonlocal planned, p_inflight
        assert planned is not None
        batch, planned = planned, None
        index = requested
        sms = rule.prefill_sms(index)
        busy = bool(running or waiting or d_inflight)
        shape = prefill_shape(batch)
        predicted = model.predict(shape, sms, busy, index).seconds
        real = steps.noisy_seconds(shape, sms, busy, rng)
        done = []
        for i, take in batch:
            computed[i] += take
            if computed[i] >= reqs[i].num_prompt_tokens:
                done.append(i)
        p_inflight = {"shape": shape, "sms": sms, "busy": busy, "index": index, "predicted": predicted,
                      "predicted_end": now + predicted, "done": done}
        out.timeline.append(("prefill", now, index))
        push(now + real, "prefill_end", real)
        decide(now)  # plan-ahead: the next batch is planned (and the split decided) as this one launches

    def launch_decode(now: float) -> None:
        nonlocal d_inflight, waiting
        joined = [s for s in waiting if s.ready_s <= now]
        waiting = [s for s in waiting if s.ready_s > now]
        running.extend(joined)
        if not running:
            return
        index = requested
        sms = rule.decode_sms[index]
        busy = p_inflight is not None
        shape = StepShape.decode(len(running), sum(s.context for s in running))
        real = steps.noisy_seconds(shape, sms, busy, rng)
        d_inflight = {"shape": shape, "sms": sms, "busy": busy, "index": index,
                      "predicted": model.predict(shape, sms, busy, index).seconds}
        out.max_decode_seqs = max(out.max_decode_seqs, len(running))
        out.decode_sms_s[sms] = out.decode_sms_s.get(sms, 0.0) + real
        out.timeline.append(("decode", now, index))
        push(now + real, "decode_end", real)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            computed[payload], entered[payload] = 0, now
            if planned is None:  # the side waits for work: plan at once (during a step in flight too)
                decide(now)
        elif kind == "prefill_end":
            step = p_inflight
            assert step is not None
            p_inflight = None
            model.observe(step["shape"], step["sms"], step["busy"], step["index"], payload)
            out.model_errors["prefill"].append(abs(step["predicted"] - payload) / payload)
            for i in step["done"]:
                del computed[i]
                first[i] = now
                out.ttft_s[i] = now + half - reqs[i].scheduled_s
                out.num_tokens[i] = 1
                if reqs[i].num_output_tokens > 1:
                    waiting.append(_Seq(i, reqs[i].num_prompt_tokens + 1, 1, now + relay_s))
                    push(now + relay_s, "handoff")
            if planned is not None:
                launch_prefill(now)
        elif kind == "decode_end":
            step, d_inflight = d_inflight, None
            assert step is not None
            last_decode_s = payload
            last_decode = (step["shape"], step["sms"], step["busy"], step["index"], payload)
            out.model_errors["decode"].append(abs(step["predicted"] - payload) / payload)
            for s in running:
                s.tokens += 1
                s.context += 1
                if s.tokens == reqs[s.index].num_output_tokens:
                    out.num_tokens[s.index] = s.tokens
                    out.tpot_s[s.index] = (now - first[s.index]) / (s.tokens - 1)
            running[:] = [s for s in running if s.tokens < reqs[s.index].num_output_tokens]
            if p_inflight is None and planned is None:  # prefill idles: a decision at each decode step
                decide(now)
            launch_decode(now)
        elif kind == "handoff" and d_inflight is None:
            launch_decode(now)
    return out


# scoring and the command line ---------------------------------------------------------------------------------
def score(reqs: Sequence[Request], ttft_s: Sequence[float | None], tpot_s: Sequence[float | None]) -> dict[str, Any]:
    """Strict attainment and miss kinds (rescore.miss_kinds) of replayed or measured times."""
    slo = PRESETS["strict"]
    recs = [SimpleNamespace(success=t is not None, ttft_s=t, tpot_s=p, prompt_tokens=r.num_prompt_tokens)
            for r, t, p in zip(reqs, ttft_s, tpot_s)]
    return {"attainment": attainment(recs, slo), **miss_kinds(recs, slo)}


def make_policy(roofline_factory: Callable[[], PerfModel], margin_ms: float, scope: str, token_cap: int,
                ladder: Sequence[int] = tuple(default_ladder(SM_COUNT))) -> BulletPolicy:
    """BulletPolicy as policy_link.SplitDecider builds it, on a fresh model (online correction empty)."""
    cfg = EngineConfig(ttft_margin_ms=margin_ms, ttft_margin_scope=scope, max_num_batched_tokens=token_cap)
    return BulletPolicy(roofline_factory(), list(ladder), SM_COUNT, cfg.planning_targets(), token_cap=token_cap,
                        settings=cfg.split_settings(), split_targets=cfg.split_targets())


def profile_model_factory() -> Callable[[], PerfModel]:
    """Fresh PerfModels from the H200 profile the runs loaded (as policy_link.make_perf_model finds it)."""
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.loader import preset_hf_config
    from bullet_ray.perf.profile import find_profile

    cfg = ModelConfig.from_hf_dict(preset_hf_config(PROFILE_MODEL))
    profile = find_profile(PROFILE_DEVICE, cfg, "bfloat16")
    if profile is None:
        raise SystemExit(f"no performance profile for {PROFILE_DEVICE}, {PROFILE_MODEL}")
    return lambda: PerfModel.from_profile(profile, cfg)


def token_cap_of(steps_path: Path) -> int:
    """max_num_batched_tokens of the deployment YAML beside the step log (<system>.yaml), else EngineConfig's."""
    import yaml

    path = Path(str(steps_path).replace("-steps.jsonl.gz", ".yaml").replace("-steps.jsonl", ".yaml"))
    if path.is_file():
        doc = yaml.safe_load(path.read_text())
        for app in doc.get("applications", []):
            cap = app.get("args", {}).get("engine", {}).get("max_num_batched_tokens")
            if cap:
                return int(cap)
    return EngineConfig().max_num_batched_tokens


def steps_path_of(run: Path) -> Path:
    """runs/<system>-rate<R>.json.gz -> <system>-steps.jsonl.gz beside runs/."""
    system = run.name.split("-rate")[0]
    return run.parent.parent / f"{system}-steps.jsonl.gz"


def _mean_min_max(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def run_grid(reqs: list[Request], steps: StepModel, factory: Callable[[], PerfModel], token_cap: int,
             margins: list[float], scopes: list[str], seeds: int, overhead_s: float,
             progress: bool = True, warm: Sequence[dict] = ()) -> list[dict[str, Any]]:
    from tqdm import tqdm

    cells = [(m, s) for m in margins for s in scopes]
    bar = tqdm(total=len(cells) * seeds, disable=not progress, file=sys.stderr, desc="replays")
    rows = []
    for margin, scope in cells:
        per_seed: list[dict[str, Any]] = []
        for seed in range(seeds):
            outcome = replay(reqs, steps, make_policy(factory, margin, scope, token_cap), random.Random(seed),
                             overhead_s, warm=warm)
            sc = score(reqs, outcome.ttft_s, outcome.tpot_s)
            busy = sum(outcome.decode_sms_s.values())
            sc["decisions"] = dict(outcome.decisions)
            sc["decode_time_share_by_sms"] = {str(k): v / busy for k, v in sorted(outcome.decode_sms_s.items())}
            sc["prefill_model_error_median"] = statistics.median(outcome.model_errors["prefill"])
            sc["decode_model_error_median"] = statistics.median(outcome.model_errors["decode"])
            per_seed.append(sc)
            bar.update()
        row: dict[str, Any] = {"margin_ms": margin, "scope": scope, "seeds": per_seed}
        for key in ("attainment", "ttft", "tpot", "both", "failed", "balance"):
            vals = [float(s["decisions"].get("balance", 0)) if key == "balance" else float(s[key]) for s in per_seed]
            row[key] = _mean_min_max(vals)
        row["seeds_tpot_only_ge_20"] = sum(s["tpot"] >= COLLAPSE_TPOT_MISSES for s in per_seed)
        row["model_error_median"] = {p: statistics.fmean(s[f"{p}_model_error_median"] for s in per_seed)
                                     for p in ("prefill", "decode")}
        rows.append(row)
    bar.close()
    return rows


def _scopes(text: str) -> list[str]:
    scopes = [s for s in text.split(",") if s]
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"--scopes: unknown scope(s) {bad or [text]}; choose from {', '.join(SCOPES)}")
    return scopes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=RUN, help="serve_bench run file (.json or .json.gz)")
    parser.add_argument("--steps", type=Path, default=None,
                        help="step log of the same system (default: <system>-steps.jsonl.gz beside runs/)")
    parser.add_argument("--margins", default="0,25,50", help="comma-separated TTFT planning margins (ms)")
    parser.add_argument("--scopes", default="all,order", help="comma-separated margin scopes: all, order")
    parser.add_argument("--seeds", type=int, default=5, help="noise seeds per (margin, scope)")
    parser.add_argument("--overhead-ms", type=float, default=14.0, help="time outside the workers (ms), half each way")
    parser.add_argument("--no-noise", action="store_true", help="step times exactly as fitted (one replay per cell)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--no-warm", dest="warm", action="store_false",
                        help="start the online correction empty (default: it first learns the log's steps from before "
                             "the run, the earlier rates the same server served)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        scopes = _scopes(args.scopes)
        margins = [float(m) for m in args.margins.split(",") if m]
    except ValueError as e:
        parser.exit(2, f"replay_split: error: {e if str(e).startswith('--') else f'--margins: {e}'}\n")
    if args.seeds < 1:
        parser.exit(2, f"replay_split: error: --seeds must be >= 1, got {args.seeds}\n")
    steps_path = args.steps or steps_path_of(args.run)
    reqs, measured = load_requests(args.run)
    factory = profile_model_factory()
    log_records = records(str(steps_path))
    steps = fit_step_model(log_records, factory())
    warm: list[dict] = []
    if args.warm:
        try:
            warm = steps_before(log_records, run_start_unix_s(load_bench_run(args.run)))
        except KeyError:  # a run file without its start time: nothing to warm on
            logger.warning("%s has no start time: the online correction starts empty", args.run)
    if args.no_noise:
        steps.sigma = {p: 0.0 for p in steps.sigma}
    token_cap = token_cap_of(steps_path)
    started = time.perf_counter()
    rows = run_grid(reqs, steps, factory, token_cap, margins, scopes, 1 if args.no_noise else args.seeds,
                    args.overhead_ms / 1e3, args.progress, warm)
    elapsed = time.perf_counter() - started
    real = score(reqs, [r.ttft_s if r.success else None for r in measured], [r.tpot_s for r in measured])
    print(f"MODEL, not a measurement. run {args.run.name}: {len(reqs)} requests over {reqs[-1].scheduled_s:.2f} s; "
          f"step log {steps_path.name}; token cap {token_cap}; overhead {args.overhead_ms:g} ms; "
          f"{'no noise' if args.no_noise else f'{args.seeds} seeds'}; online correction warmed on {len(warm)} logged "
          f"steps from before the run; {elapsed:.1f} s")
    print("step fits (s = fixed + a x1 + b x2; prefill x = tokens, pairs; decode x = seqs, context tokens):")
    for (phase, sms, busy), fit in sorted(steps.fits.items()):
        print(f"  {phase:7} {sms:3} SMs other_busy={busy!s:5} n={fit.num_steps:4} fixed {fit.coef[0] * 1e3:7.3f} ms "
              f"a {fit.coef[1] * 1e6:8.4f} us b {fit.coef[2] * 1e9:9.5f} ns  fit error median {fit.median_error:.1%} "
              f"p90 {fit.p90_error:.1%}")
    print(f"noise sigma prefill {steps.sigma['prefill']:.4f} decode {steps.sigma['decode']:.4f} (log's p90 error "
          f"prefill {steps.p90_log_error['prefill']:.1%}, decode {steps.p90_log_error['decode']:.1%})")
    print("misses by kind (rescore.miss_kinds, strict): mean over seeds [min, max]; balance: BALANCE decisions")
    print(f"{'margin':>6} {'scope':>5} {'attain':>7} {'[min,max]':>13} {'ttft_only':>15} {'tpot_only':>15} "
          f"{'both':>5} {'fail':>4} {'balance':>7} {'pred_err_p/d':>12} {'seeds_tpot>=20':>14}")
    print(f"{'MEASURED':>12} {real['attainment']:>7.1%} {'':>13} {real['ttft']:>15} {real['tpot']:>15} "
          f"{real['both']:>5} {real['failed']:>4}")

    def spread(v: dict[str, float]) -> str:
        return f"{v['mean']:5.1f} [{v['min']:g},{v['max']:g}]"
    for row in rows:
        a = row["attainment"]
        print(f"{row['margin_ms']:>6g} {row['scope']:>5} {a['mean']:>7.1%} [{a['min']:>5.1%},{a['max']:>5.1%}] "
              f"{spread(row['ttft']):>15} {spread(row['tpot']):>15} {row['both']['mean']:>5.1f} "
              f"{row['failed']['mean']:>4.1f} {row['balance']['mean']:>7.1f} "
              f"{row['model_error_median']['prefill']:>5.1%}/{row['model_error_median']['decode']:.1%} "
              f"{row['seeds_tpot_only_ge_20']:>8}/{len(row['seeds'])}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "note": "replayed by a model (benchmarks/replay_split.py), not measured on a GPU",
            "run": str(args.run), "steps": str(steps_path), "token_cap": token_cap, "overhead_ms": args.overhead_ms,
            "num_warm_steps": len(warm),
            "noise_sigma": steps.sigma, "p90_log_error": steps.p90_log_error, "elapsed_s": elapsed,
            "fits": {f"{k[0]}/{k[1]}/{'busy' if k[2] else 'alone'}": fit.__dict__ for k, fit in steps.fits.items()},
            "measured": real, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
