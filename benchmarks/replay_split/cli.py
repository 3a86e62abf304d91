"""The command line of benchmarks.replay_split: a grid of (margin, scope) x noise seeds over one run, scored beside
the measured run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks.plot_steps import records, run_start_unix_s
from benchmarks.replay_split.fits import StepModel, fit_step_model
from benchmarks.replay_split.noise import NOISES, Delays, delays_from_log, lag_autocorrelation, residual_noise
from benchmarks.replay_split.sim import AT_RISK, DecodePause, Request, load_requests, replay, steps_before
from benchmarks.rescore import load_run as load_bench_run
from benchmarks.rescore import miss_kinds
from bullet_ray.bench.slo import PRESETS, attainment
from bullet_ray.config import EngineConfig, parse_ladder
from bullet_ray.errors import ConfigError
from bullet_ray.gpu.partition import default_ladder
from bullet_ray.perf.model import PerfModel
from bullet_ray.policy.bullet import BulletPolicy
from bullet_ray.policy.state import SplitReason

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parents[1] / "results" / "serve_h200_m3a"
RUN = RESULTS / "runs" / "bullet-slo+direct-rate40.json.gz"
SCOPES = ("all", "order")
COLLAPSE_TPOT_MISSES = 20  # a seed with this many TPOT-only misses counts as a TPOT collapse (the run: 45-48)
SM_COUNT = 132
PROFILE_MODEL = "llama-3.1-8b"
PROFILE_DEVICE = "NVIDIA H200"


def score(reqs: Sequence[Request], ttft_s: Sequence[float | None], tpot_s: Sequence[float | None],
          slo_name: str = "strict") -> dict[str, Any]:
    """Attainment and miss kinds (rescore.miss_kinds) of replayed or measured times under SLO preset `slo_name`."""
    slo = PRESETS[slo_name]
    recs = [SimpleNamespace(success=t is not None, ttft_s=t, tpot_s=p, prompt_tokens=r.num_prompt_tokens)
            for r, t, p in zip(reqs, ttft_s, tpot_s)]
    return {"attainment": attainment(recs, slo), **miss_kinds(recs, slo)}


def make_policy(roofline_factory: Callable[[], PerfModel], margin_ms: float, scope: str, token_cap: int,
                ladder: Sequence[int] = tuple(default_ladder(SM_COUNT)),
                split_rule: dict[str, Any] | None = None, prefill_order: str = "least_slack",
                slo_name: str = "strict", fallback_ms: float | None = None,
                backlog_batch_tokens: int | None = None,
                saturation_share: float = EngineConfig.prefill_saturation_share) -> BulletPolicy:
    """BulletPolicy as the prefill worker builds it (EngineConfig.bullet_policy), on a fresh model (online correction empty); `split_rule`:
    EngineConfig.split_rule (the split rule's settings, None: SplitSettings' defaults); `prefill_order`:
    EngineConfig.prefill_order; `slo_name`: the SLO preset whose targets the policy aims at (slo_targets);
    `fallback_ms`: EngineConfig.ttft_fallback_ms; `backlog_batch_tokens`: EngineConfig.prefill_backlog_batch_tokens;
    `saturation_share`: EngineConfig.prefill_saturation_share."""
    ttft_ms, tpot_ms = slo_targets(slo_name)
    cfg = EngineConfig(ttft_margin_ms=margin_ms, ttft_margin_scope=scope, max_num_batched_tokens=token_cap,
                       split_rule=split_rule, prefill_order=prefill_order, ttft_target_ms=ttft_ms,
                       tpot_target_ms=tpot_ms, ttft_fallback_ms=fallback_ms,
                       prefill_backlog_batch_tokens=backlog_batch_tokens, prefill_saturation_share=saturation_share)
    return cfg.bullet_policy(roofline_factory(), list(ladder), SM_COUNT)


def slo_targets(slo_name: str) -> tuple[float, float]:
    """EngineConfig's (ttft_target_ms, tpot_target_ms) for a fixed-TTFT SLO preset (strict: the engine's defaults,
    500 / 25 ms; relaxed: 1,000 / 50 ms, the relaxed-aimed deployment's), as serve_h100's bullet-slo-<preset> systems
    set them."""
    targets = PRESETS[slo_name].engine_targets()
    if "ttft_target_ms_per_prompt_token" in targets:
        raise ValueError(f"{slo_name!r} sets its TTFT target per prompt token; choose a preset with a fixed one")
    return targets["ttft_target_ms"], targets["tpot_target_ms"]


def profile_model_factory() -> Callable[[], PerfModel]:
    """Fresh PerfModels from the H200 profile as policy_link.make_perf_model finds it: the shipped one (measured on an
    H200 since the thirty-sixth session), or BULLET_RAY_PROFILE_DIR's. Runs served before it loaded the profile derived
    from the H100's: BULLET_RAY_PROFILE_DIR=benchmarks/results/derived_h200_profile replays them with that one (a
    step log's `startup` records name the profile since then)."""
    from bullet_ray.models.config import ModelConfig
    from bullet_ray.models.loader import preset_hf_config
    from bullet_ray.perf.profile import find_profile

    cfg = ModelConfig.from_hf_dict(preset_hf_config(PROFILE_MODEL))
    profile = find_profile(PROFILE_DEVICE, cfg, "bfloat16")
    if profile is None:
        raise SystemExit(f"no performance profile for {PROFILE_DEVICE}, {PROFILE_MODEL}")
    return lambda: PerfModel.from_profile(profile, cfg)


def engine_args_of(steps_path: Path) -> dict[str, Any]:
    """The engine args of the deployment YAML beside the step log (<system>-steps.jsonl[.gz] -> <system>.yaml), {}
    without one (or for a step log not named so)."""
    import yaml

    name = steps_path.name
    suffix = next((x for x in ("-steps.jsonl.gz", "-steps.jsonl") if name.endswith(x)), None)
    path = steps_path.with_name(name[:-len(suffix)] + ".yaml") if suffix else None
    if path is not None and path.is_file():
        doc = yaml.safe_load(path.read_text())
        for app in doc.get("applications", []):
            engine = app.get("args", {}).get("engine")
            if engine:
                return dict(engine)
    return {}


def token_cap_of(steps_path: Path) -> int:
    """max_num_batched_tokens of the deployment YAML beside the step log (<system>.yaml), else EngineConfig's."""
    cap = engine_args_of(steps_path).get("max_num_batched_tokens")
    return int(cap) if cap else EngineConfig().max_num_batched_tokens


def ladder_of(steps_path: Path) -> list[int]:
    """The split ladder (decode SM counts) the logged run used: engine.decode_sm_counts of the YAML beside the step
    log (a -fl<SMs> system's), else the default ladder; the log's split_index and the replay's entries then agree."""
    counts = engine_args_of(steps_path).get("decode_sm_counts")
    return [int(c) for c in counts] if counts else default_ladder(SM_COUNT)


def steps_path_of(run: Path) -> Path:
    """runs/<system>-rate<R>.json.gz -> <system>-steps.jsonl.gz beside runs/."""
    system = run.name.split("-rate")[0]
    return run.parent.parent / f"{system}-steps.jsonl.gz"


def _mean_min_max(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def run_grid(reqs: list[Request], steps: StepModel, factory: Callable[[], PerfModel], token_cap: int,
             margins: list[float], scopes: list[str], seeds: int, overhead_s: float,
             progress: bool = True, warm: Sequence[dict] = (), delays: Delays | None = None,
             split_rule: dict[str, Any] | None = None, pause: DecodePause | None = None,
             prefill_order: str = "least_slack", slo_name: str = "strict",
             score_slo: str | None = None, fallback_ms: float | None = None,
             ladder: Sequence[int] = tuple(default_ladder(SM_COUNT)),
             backlog_batch_tokens: int | None = None,
             saturation_share: float = EngineConfig.prefill_saturation_share) -> list[dict[str, Any]]:
    """Replays of every (margin, scope) x seed on the split `ladder`; the policy aims at SLO preset `slo_name`, each
    replay is scored under `score_slo` (default: the same)."""
    from tqdm import tqdm

    cells = [(m, s) for m in margins for s in scopes]
    bar = tqdm(total=len(cells) * seeds, disable=not progress, file=sys.stderr, desc="replays")
    rows = []
    for margin, scope in cells:
        per_seed: list[dict[str, Any]] = []
        for seed in range(seeds):
            policy = make_policy(factory, margin, scope, token_cap, ladder, split_rule=split_rule,
                                 prefill_order=prefill_order, slo_name=slo_name, fallback_ms=fallback_ms,
                                 backlog_batch_tokens=backlog_batch_tokens, saturation_share=saturation_share)
            outcome = replay(reqs, steps, policy, random.Random(seed),
                             overhead_s, warm=warm, delays=delays, pause=pause)
            sc = score(reqs, outcome.ttft_s, outcome.tpot_s, score_slo or slo_name)
            busy = sum(outcome.decode_sms_s.values())
            sc["decisions"] = dict(outcome.decisions)
            sc["num_pauses"] = len(outcome.pauses)
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
        row["pauses"] = _mean_min_max([float(s["num_pauses"]) for s in per_seed])
        row["model_error_median"] = {p: statistics.fmean(s[f"{p}_model_error_median"] for s in per_seed)
                                     for p in ("prefill", "decode")}
        rows.append(row)
    bar.close()
    return rows


def _q(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def describe_residuals(noise: Any, phase: str) -> str:
    v = noise.sets[phase]
    err = [abs(x - 1) for x in v]
    return (f"{phase} {len(v)} ratios p1 {_q(v, 0.01):.3f} p50 {_q(v, 0.5):.3f} p99 {_q(v, 0.99):.3f}, |err| p50 "
            f"{_q(err, 0.5):.1%} p90 {_q(err, 0.9):.1%}, lag-1 autocorr {lag_autocorrelation(v):.2f}, block "
            f"{noise.block_steps.get(phase, 1.0):.1f} steps, {sum(isinstance(k, tuple) and k[0] == phase for k in noise.sets)}"
            f" own entries")


def describe_delays(raw: Sequence[float], kept: Sequence[float], name: str) -> str:
    return (f"{name} n={len(raw)} measured {_q(raw, 0.5) * 1e3:.1f} / {_q(raw, 0.9) * 1e3:.1f} / "
            f"{max(raw, default=0) * 1e3:.1f}, extra {_q(kept, 0.5) * 1e3:.1f} / {_q(kept, 0.9) * 1e3:.1f} / "
            f"{max(kept, default=0) * 1e3:.1f}")


def _scopes(text: str) -> list[str]:
    scopes = [s for s in text.split(",") if s]
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(f"--scopes: unknown scope(s) {bad or [text]}; choose from {', '.join(SCOPES)}")
    return scopes


def main(argv: list[str] | None = None) -> int:
    package_doc = sys.modules[__package__].__doc__  # the package's docstring: what the replay models and leaves out
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay_split", description=package_doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, default=RUN, help="serve_bench run file (.json or .json.gz)")
    parser.add_argument("--steps", type=Path, default=None,
                        help="step log of the same system (default: <system>-steps.jsonl.gz beside runs/)")
    parser.add_argument("--margins", default="0,25,50", help="comma-separated TTFT planning margins (ms)")
    parser.add_argument("--scopes", default="all,order", help="comma-separated margin scopes: all, order")
    parser.add_argument("--seeds", type=int, default=5, help="noise seeds per (margin, scope)")
    parser.add_argument("--overhead-ms", type=float, default=14.0, help="time outside the workers (ms), half each way")
    parser.add_argument("--no-noise", action="store_true", help="step times exactly as fitted (one replay per cell)")
    parser.add_argument("--noise", default="lognormal",
                        help="step noise: lognormal (fitted x lognormal at the log's p90 error), empirical (fitted x "
                             "the log's own measured / fitted ratios, per side and SM entry, in blocks as long as the "
                             "log's autocorrelation says), empirical-iid (the same ratios, drawn independently)")
    parser.add_argument("--delays", default="none",
                        help="none, or log: each arrival and hand-off waits a delay drawn from the run window's "
                             "first_token / handoff records, less the step-boundary waits the replay models")
    parser.add_argument("--prefill-speedup", type=float, default=1.0,
                        help="what-if: every prefill step this many times faster than the log's fit (default 1)")
    parser.add_argument("--split-rule", default=None,
                        help="the split rule's settings as a JSON object (EngineConfig.split_rule, the fields of "
                             "bullet_ray.policy.split.SplitSettings: aim, backlog_aim, hold_below, ...), e.g. "
                             "'{\"aim\": 0.9}'; default: SplitSettings' defaults, as the engine runs")
    parser.add_argument("--prefill-order", default="least_slack",
                        help="the prefill queue's order (EngineConfig.prefill_order): least_slack (default), "
                             "max_on_time (the most requests that make their TTFT targets together) or "
                             "fallback_first (the most that make --fallback-ms, as many as can their target)")
    parser.add_argument("--ladder", default=None,
                        help="what-if: the split ladder's decode SM counts, comma-separated and ascending (e.g. "
                             "8,16,24,...,112 for a decode floor of 8 SMs, serve_h100's -fl8); an entry the log never "
                             "ran on takes the nearest fitted entry's time scaled by the profile's roofline; "
                             "default: the logged run's own ladder (engine.decode_sm_counts in the YAML beside the "
                             "step log, else 16, 24, ..., 112)")
    parser.add_argument("--fallback-ms", type=float, default=None,
                        help="EngineConfig.ttft_fallback_ms: a second, later TTFT target a late request is still "
                             "ordered for (default: none, as the engine)")
    parser.add_argument("--backlog-batch-tokens", type=int, default=None,
                        help="EngineConfig.prefill_backlog_batch_tokens: while a queued request misses its TTFT target "
                             "whatever the split, prefill batches may grow to this many tokens (at most the run's token "
                             "cap) instead of stopping at saturation (default: none, as the engine). The step fit is "
                             "fixed + per token + per pair, so a larger step gains only its share of the fixed cost")
    parser.add_argument("--saturation-share", type=float, default=EngineConfig.prefill_saturation_share,
                        help="EngineConfig.prefill_saturation_share: a prefill batch stops growing where the model "
                             "puts throughput within this share of the best (default: the engine's, %(default)g)")
    parser.add_argument("--slo", default="strict",
                        help="the SLO preset (bullet_ray.bench.slo) the replayed policy aims at and (unless --score-slo) "
                             "the attainment is scored against, one with a fixed TTFT target: strict (default: the engine's targets, "
                             "500 / 25 ms) or relaxed (1,000 / 50 ms, the relaxed-aimed deployment's; with --margins 0 "
                             "as it ran)")
    parser.add_argument("--score-slo", default=None,
                        help="score the replays (and the measured run) under this SLO preset instead of --slo's, "
                             "e.g. --slo strict --score-slo relaxed: the strict-aimed deployment judged by the relaxed "
                             "SLO")
    parser.add_argument("--decode-pause", type=float, default=None, metavar="SPEEDUP",
                        help="what-if the engine does not have (sim.DecodePause): after a BACKLOG or BALANCE split "
                             "decision, a prefill step runs on the whole GPU with decode paused, if every running "
                             "sequence's TPOT stays under --decode-pause-aim x the target; SPEEDUP: that step's speed "
                             "over the log's 116-SM step with decode idle (1.1: the whole GPU's ~41k against ~37k "
                             "tokens/s), times --prefill-speedup")
    parser.add_argument("--decode-pause-aim", type=float, default=None,
                        help="with --decode-pause: the share of the TPOT target every running sequence's TPOT must "
                             "stay under with the pause added (default 0.9)")
    parser.add_argument("--decode-pause-reasons", default=None,
                        help="with --decode-pause: the split decisions after which a pause may run, a comma list of "
                             "SplitReason values (default backlog,balance; to_prefill adds TTFT at risk with decode "
                             "within its TPOT target), or at_risk: after any decision that predicts a queued request "
                             "past its TTFT target (HOLD included, the relaxed-aimed policy's usual state in a burst)")
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
    if args.noise not in NOISES:
        parser.exit(2, f"replay_split: error: --noise: unknown noise {args.noise!r}; choose from {', '.join(NOISES)}\n")
    if args.delays not in ("none", "log"):
        parser.exit(2, f"replay_split: error: --delays: unknown value {args.delays!r}; choose from none, log\n")
    split_rule = None
    if args.split_rule is not None:
        try:
            split_rule = json.loads(args.split_rule)
            if not isinstance(split_rule, dict):
                raise ValueError(f"need a JSON object, got {args.split_rule!r}")
            EngineConfig(split_rule=split_rule)  # unknown or out-of-range settings named here
        except (ValueError, ConfigError) as e:
            parser.exit(2, f"replay_split: error: --split-rule: {e}\n")

    def check(flag: str, **fields: Any) -> None:
        """EngineConfig's own check of the fields a flag sets: its error, naming the flag, ends the command."""
        try:
            EngineConfig(**fields)
        except ConfigError as e:
            parser.exit(2, f"replay_split: error: {flag}: {e}\n")

    for flag, name in (("--slo", args.slo), ("--score-slo", args.score_slo)):
        if name is not None and name not in PRESETS:
            parser.exit(2, f"replay_split: error: {flag}: unknown preset {name!r}; choose from {', '.join(PRESETS)}\n")
    score_slo = args.score_slo or args.slo
    try:
        ttft_ms, tpot_ms = slo_targets(args.slo)
    except ValueError as e:
        parser.exit(2, f"replay_split: error: --slo: {e}\n")
    for margin in margins:  # a margin the targets cannot take (>= the TTFT target, < 0) named before any replay
        check("--margins", ttft_margin_ms=margin, ttft_target_ms=ttft_ms, tpot_target_ms=tpot_ms)
    check("--fallback-ms", ttft_target_ms=ttft_ms, tpot_target_ms=tpot_ms, ttft_fallback_ms=args.fallback_ms)
    check("--prefill-order", prefill_order=args.prefill_order, ttft_target_ms=ttft_ms, tpot_target_ms=tpot_ms,
          ttft_fallback_ms=args.fallback_ms)  # fallback_first needs --fallback-ms
    check("--backlog-batch-tokens", prefill_backlog_batch_tokens=args.backlog_batch_tokens)
    check("--saturation-share", prefill_saturation_share=args.saturation_share)
    if args.decode_pause is not None and not 0 < args.decode_pause < float("inf"):
        parser.exit(2, f"replay_split: error: --decode-pause must be > 0, got {args.decode_pause}\n")
    if args.decode_pause_aim is not None and (args.decode_pause is None or not 0 < args.decode_pause_aim < float("inf")):
        parser.exit(2, f"replay_split: error: --decode-pause-aim: a share > 0 that goes with --decode-pause, got "
                       f"{args.decode_pause_aim}\n")
    aim = 0.9 if args.decode_pause_aim is None else args.decode_pause_aim
    reasons = DecodePause.reasons
    if args.decode_pause_reasons is not None:
        known = [r.value for r in SplitReason] + [AT_RISK]
        reasons = tuple(r.strip() for r in args.decode_pause_reasons.split(",") if r.strip())
        unknown = [r for r in reasons if r not in known]
        if args.decode_pause is None or not reasons or unknown:
            parser.exit(2, f"replay_split: error: --decode-pause-reasons: a comma list of {', '.join(known)} that goes "
                           f"with --decode-pause, got {args.decode_pause_reasons!r}\n")
    pause = (DecodePause(speedup=args.decode_pause, tpot_aim=aim, reasons=reasons)
             if args.decode_pause is not None else None)
    if args.seeds < 1:
        parser.exit(2, f"replay_split: error: --seeds must be >= 1, got {args.seeds}\n")
    if not 0 < args.prefill_speedup < float("inf"):
        parser.exit(2, f"replay_split: error: --prefill-speedup must be > 0, got {args.prefill_speedup}\n")
    steps_path = args.steps or steps_path_of(args.run)
    ladder = ladder_of(steps_path)
    if args.ladder is not None:
        try:
            ladder = parse_ladder(args.ladder)
            if ladder[-1] >= SM_COUNT:
                raise ValueError(f"decode SM counts must stay below the GPU's {SM_COUNT}, got {ladder[-1]}")
        except ValueError as e:
            parser.exit(2, f"replay_split: error: --ladder: {e}\n")
    reqs, measured = load_requests(args.run)
    factory = profile_model_factory()
    log_records = records(str(steps_path))
    steps = fit_step_model(log_records, factory())
    steps.prefill_speedup = args.prefill_speedup
    warm: list[dict] = []
    bench_run = load_bench_run(args.run)
    try:
        start_unix_s: float | None = run_start_unix_s(bench_run)
    except KeyError:  # a run file without its start time: nothing to warm on, no window for the delays
        start_unix_s = None
    if args.warm:
        if start_unix_s is not None:
            warm = steps_before(log_records, start_unix_s)
        else:
            logger.warning("%s has no start time: the online correction starts empty", args.run)
    if args.noise != "lognormal" and not args.no_noise:
        steps.residuals = residual_noise(log_records, steps, persistent=args.noise == "empirical")
    delays = None
    if args.delays == "log":
        if start_unix_s is None:
            parser.exit(2, f"replay_split: error: --delays log: {args.run} has no start time to find its window\n")
        delays = delays_from_log(log_records, start_unix_s, start_unix_s + float(bench_run["summary"]["duration_s"]))
    if args.no_noise:
        steps.sigma = {p: 0.0 for p in steps.sigma}
    token_cap = token_cap_of(steps_path)
    started = time.perf_counter()
    rows = run_grid(reqs, steps, factory, token_cap, margins, scopes, 1 if args.no_noise else args.seeds,
                    args.overhead_ms / 1e3, args.progress, warm, delays, split_rule, pause, args.prefill_order,
                    args.slo, score_slo, args.fallback_ms, ladder, args.backlog_batch_tokens, args.saturation_share)
    elapsed = time.perf_counter() - started
    real = score(reqs, [r.ttft_s if r.success else None for r in measured], [r.tpot_s for r in measured], score_slo)
    print(f"MODEL, not a measurement. run {args.run.name}: {len(reqs)} requests over {reqs[-1].scheduled_s:.2f} s; "
          f"step log {steps_path.name}; token cap {token_cap}; overhead {args.overhead_ms:g} ms; "
          f"{'no noise' if args.no_noise else f'{args.seeds} seeds'}"
          f"{'' if args.noise == 'lognormal' else f' (noise {args.noise})'}"
          f"{'' if delays is None else ' (delays from the log)'}"
          f"{'' if args.prefill_speedup == 1 else f'; prefill steps {args.prefill_speedup:g}x faster than logged'}"
          f"{'' if split_rule is None else f'; split rule {json.dumps(split_rule)}'}"
          f"{'' if args.prefill_order == 'least_slack' else f'; prefill order {args.prefill_order}'}"
          f"{'' if args.fallback_ms is None else f'; fallback TTFT target {args.fallback_ms:g} ms'}"
          f"{'' if args.backlog_batch_tokens is None else f'; backlog batches up to {args.backlog_batch_tokens} tokens'}"
          f"{'' if args.saturation_share == EngineConfig.prefill_saturation_share else f'; batches to {args.saturation_share:g} of the best throughput'}"
          f"{'' if ladder == default_ladder(SM_COUNT) else f'; split ladder (decode SMs) {ladder}'}"
          f"{'' if args.slo == 'strict' else f'; aimed at SLO {args.slo}'}"
          f"{'' if score_slo == 'strict' else f'; scored by SLO {score_slo}'}"
          f"{'' if pause is None else f'; WHAT-IF decode pause (whole-GPU prefill {pause.speedup:g}x the 116-SM fit, '}"
          f"{'' if pause is None else f'TPOT under {pause.tpot_aim:g} x target, after ' + '/'.join(pause.reasons) + ')'}"
          f"; online correction warmed on {len(warm)} logged "
          f"steps from before the run; {elapsed:.1f} s")
    print("step fits (s = fixed + a x1 + b x2; prefill x = tokens, pairs; decode x = seqs, context tokens):")
    for (phase, sms, busy), fit in sorted(steps.fits.items()):
        print(f"  {phase:7} {sms:3} SMs other_busy={busy!s:5} n={fit.num_steps:4} fixed {fit.coef[0] * 1e3:7.3f} ms "
              f"a {fit.coef[1] * 1e6:8.4f} us b {fit.coef[2] * 1e9:9.5f} ns  fit error median {fit.median_error:.1%} "
              f"p90 {fit.p90_error:.1%}")
    if steps.residuals is None:
        print(f"noise sigma prefill {steps.sigma['prefill']:.4f} decode {steps.sigma['decode']:.4f} (log's p90 error "
              f"prefill {steps.p90_log_error['prefill']:.1%}, decode {steps.p90_log_error['decode']:.1%})")
    else:
        print(f"noise {args.noise}: " + "; ".join(describe_residuals(steps.residuals, p) for p in ("prefill", "decode")))
    if delays is not None:
        print("delays (--delays log; ms p50 / p90 / max, extra = less the modelled step-boundary wait): "
              + "; ".join(describe_delays(raw, kept, name) for name, raw, kept in (
                  ("to_worker", delays.raw_to_worker_s, delays.to_worker_s),
                  ("handoff", delays.raw_handoff_s, delays.handoff_s))))
    print(f"misses by kind (rescore.miss_kinds, {score_slo}): mean over seeds [min, max]; balance: BALANCE decisions")
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
    if pause is not None:
        print("decode pauses (prefill steps on the whole GPU with decode held) per replay: "
              + "; ".join(f"margin {row['margin_ms']:g} {row['scope']}: {spread(row['pauses'])}" for row in rows))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "note": "replayed by a model (benchmarks/replay_split/), not measured on a GPU",
            "run": str(args.run), "steps": str(steps_path), "token_cap": token_cap, "overhead_ms": args.overhead_ms,
            "num_warm_steps": len(warm), "prefill_speedup": args.prefill_speedup, "split_rule": split_rule,
            "prefill_order": args.prefill_order, "slo": score_slo, "aim_slo": args.slo, "ladder": ladder,
            "ttft_fallback_ms": args.fallback_ms, "prefill_backlog_batch_tokens": args.backlog_batch_tokens,
            "prefill_saturation_share": args.saturation_share,
            "decode_pause": None if pause is None else dataclasses.asdict(pause),
            "noise_sigma": steps.sigma, "p90_log_error": steps.p90_log_error, "elapsed_s": elapsed,
            **({} if args.noise == "lognormal" and delays is None else {
                "noise": args.noise, "delays": args.delays,
                "block_steps": steps.residuals.block_steps if steps.residuals is not None else None,
                "delays_kept_ms": None if delays is None else {
                    "to_worker": [round(d * 1e3, 3) for d in delays.to_worker_s],
                    "handoff": [round(d * 1e3, 3) for d in delays.handoff_s]}}),
            "fits": {f"{k[0]}/{k[1]}/{'busy' if k[2] else 'alone'}": fit.__dict__ for k, fit in steps.fits.items()},
            "measured": real, "rows": rows}, indent=1))
    return 0

