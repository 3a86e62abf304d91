"""The Serve application on one GPU, launched the way users launch it (`serve run <yaml>`), and the engine's
schedules compared on the Azure conversation trace with dummy Llama-3.1-8B weights.

For each system a YAML (a copy of deploy/gpu.yaml with the system's settings: `system_yaml`) is launched with `serve run`
(which starts a local Ray cluster); the system is swept over Poisson request rates with the trace's prompt and
output lengths (benchmarks.compare), then Ctrl-C stops `serve run` and frees the GPU for the next one. System
"bullet" also answers a batch of concurrent streaming requests and one gRPC call, compared with HTTP (the Serve
application issue's GPU check; `--check-requests 0` skips it). The copies drop deploy/gpu.yaml's own split
policy (slo, strict targets, a 50 ms margin since the thirty-first session) and pin cuBLAS and no plan lead, so a
system's name states all it runs: the shipped configuration is bullet-slo-margin50-pl10+lt.

    python -m benchmarks.gpu.serve_h100 --systems bullet --out $OUT          # one device call
    python -m benchmarks.gpu.serve_h100 --systems chunked-1024,chunked-2048 --out $OUT
    python -m benchmarks.gpu.serve_h100 --merge A/compare.json B/compare.json --out benchmarks/results/serve_h100
    python -m benchmarks.gpu.serve_h100 --merge A/compare.json C/ --out ...   # C: a sweep cut short (its runs/,
                                             # with each stopped system's runs/<system>-extra.json)

Systems: bullet (prefill and decode workers side by side under MPS on a fixed complementary SM split, the
engine's default policy), bullet-slo (the same with split_policy slo: the split moves step by step), bullet-slo-lw<G>
(bullet-slo with layer-wise prefill: batches of >= 256 tokens in G layer groups, the split may move between them),
bullet-slo-late<ms> (bullet-slo whose prefill side plans its next batch <ms> before the step in flight is
predicted to end, taking arrivals meanwhile: engine.prefill_plan_lead_ms), bullet-slo-margin<ms> (bullet-slo
whose policy plans for each TTFT target <ms> shorter: engine.ttft_margin_ms, in the queue's order, the batches' fit
and the split rule; the SLO is scored as before), bullet-slo-omargin<ms> (the same margin in the order and the
batches' fit only, the split rule judging against the real targets: engine.ttft_margin_scope order),
bullet-slo-m2 (bullet-slo with the split rule of the m2 runs: no BACKLOG rule, idle decode at its fastest),
bullet-slo-overlap (bullet-slo whose split switches let each side move at its next launch without waiting for
the other: engine.split_switch overlap, the default since the eighteenth session), bullet-slo-disjoint (engine.split_switch disjoint: a side
gives up SMs only after its step in flight, the growing side waits for it), bullet-slo-mixed<tokens> (bullet-slo
with the mixed fallback: once <tokens> prompt tokens wait while decode runs, the decode worker prefills the queued
prompts in chunks inside its steps: engine.mixed_fallback_tokens), any bullet-slo system with -bb<tokens> after
it (bullet-slo-margin50-bb8192: its prefill batches grow past saturation to <tokens> while a queued request misses
its target whatever the split: engine.prefill_backlog_batch_tokens) and/or -fb<ms> (bullet-slo-margin50-fb1000: a
request that can no longer make its TTFT target is still ordered to make <ms>, in the slack the others leave:
engine.ttft_fallback_ms) and/or -pl<ms> (bullet-slo-margin50-pl10: the prefill worker plans its next batch <ms>
before its step in flight is predicted to end, reading arrivals meanwhile: engine.prefill_plan_lead_ms) and/or
-fl<SMs> (bullet-slo-relaxed-pl10-fl8: the split ladder from that decode SM floor, in steps of 8 to 112, prefill up
to 132 - <SMs>: engine.decode_sm_counts) and/or -sat<percent> (bullet-slo-margin50-sat99: a prefill batch stops
growing within that share of the best throughput the model predicts: engine.prefill_saturation_share) and/or -iw<ms>
(bullet-slo-margin50-pl10-iw5: while prefill idles and decode runs, the prefill worker decides the split again every
<ms> after decode's steps, not every 0.5 s: engine.prefill_idle_decide_ms) and/or -mx<tokens>
(bullet-slo-margin50-pl10-mot-fb1000-mx32768: the mixed fallback beside any policy but bullet-slo-mixed<tokens>, from
that many waiting prompt tokens: engine.mixed_fallback_tokens) with -mc<tokens> (its step budget, >= 16, the block
size: engine.mixed_chunk_tokens) and/or -dp<pieces> (bullet-slo-margin50-pl10-mot-fb1000-dp8: decode steps as that many
CUDA graphs of consecutive layers launched just in time, the split followed between them: engine.decode_pieces) and/or
-tf (bullet-slo-margin50-pl10-tf: under TTFT risk with decode over its TPOT target, the split rule gives decode the
fewest SMs that meet the target instead of Bullet's minimax: engine.split_rule.balance tpot_first) and/or -mot
(bullet-slo-margin50-pl10-mot: the prefill queue keeps only the most requests that make their TTFT targets together,
the longest prompts given up first: engine.prefill_order max_on_time) or -ff (bullet-slo-margin50-pl10-ff-fb1000: the
most that make the -fb target together, as many of them as can their own: engine.prefill_order fallback_first)
and/or -nogc (bullet-slo-margin50-pl10-mot-fb1000-dp32-nogc: the workers' heaps left unfrozen: engine.gc_freeze false),
bullet-slo-<preset> for an SLO preset of
bullet_ray.bench.slo other than strict (bullet-slo-relaxed,
bullet-slo-bullet-sharegpt, bullet-slo-bullet-azure-code, bullet-slo-bullet-arxiv: bullet-slo whose split policy
and SLO metric aim at that preset instead of the strict one, an SLO-aware schedule told the SLO it serves; score
it under that preset only: relaxed sets 1,000 ms / 50 ms; a per-prompt-token preset sets
engine.ttft_target_ms_per_prompt_token to its ms per token, ttft_target_ms to one token's worth of it, so that a
request's target is its ms per token x prompt tokens, and its TPOT target), chunked-<budget>
(one worker, vLLM/SGLang-style hybrid batches of <budget> tokens), and vllm: `vllm serve` (0.24.0 on the GPU
machine, installed apart from Ray and flashinfer in $VLLM_SITE) with dummy Llama-3.1-8B weights, its defaults
but prefix caching off (this project has no prefix cache yet), driven by the same client with the same
requests. Each rate of the sweep sends its own prompts (same lengths and arrivals). For vllm, its Prometheus
page (GET /metrics) is read before and after each rate's measured requests (its warm-up requests go first,
apart) and the difference saved with the rate (`probes.vllm_metrics` in compare.json's points and in
runs/vllm-rate<R>.json: engine steps, tokens per step, queue / prefill / decode time; benchmarks.vllm_metrics);
`python -m benchmarks.step_breakdown ... --peers vllm` sets them beside our step log's.

A "+handoff" suffix on a bullet system (bullet-slo+handoff) sets engine.handoff: direct (the prefill worker hands
prefilled sequences to the decode worker itself, not through the engine front; both ways time each hand-off in
the step log's `handoff` records, `python -m benchmarks.plot_steps` prints them). A "+lt" / "+ltall" suffix on an
engine system (bullet-slo-margin50+lt+direct, chunked-2048+lt+direct) sets engine.prefill_gemm: cublaslt /
cublaslt-all (at start the prefill worker times cuBLASLt's algorithms per partition, the chunked schedule's worker on
the whole GPU, and launches the fastest: bullet_ray.engine.lt_gemm; the step log's `startup` record keeps every
point's choice).

A "+direct" suffix on an engine system (chunked-2048+direct, bullet-slo+direct, chunked-2048+pw1024+direct)
launches the same YAML with RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in `serve run`'s environment (Ray Serve's
experimental direct ingress: the replica serves HTTP on its own port, 30000 and up, and the proxy's port 8000
no longer answers); the sweep goes to the replica's address, read from the Serve controller once the replica
runs (benchmarks.direct_ingress) and saved in the system's extra["direct_ingress"] (compare.json's top-level
base_url of that system still says 8000). The "bullet" system's batch and gRPC check runs for plain "bullet" only.

Beside compare.md, goodput_ci.{json,txt}: bootstrap intervals of each goodput and of each pair's ratio, with the
chance it clears 1, 1.2 and 1.25 (benchmarks.goodput_ci over out/runs/; a merge's folder gets them once its
runs/ is there: `python -m benchmarks.goodput_ci DIR`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from benchmarks import direct_ingress, report
from benchmarks.compare import (
    SystemSpec,
    comparison_markdown,
    refuse_if_answering,
    run_comparison,
    stop_on_sigterm,
    track_group,
    untrack_group,
    wait_ready,
)
from benchmarks.offline import ENGINE_VARIANTS
from benchmarks.serve_bench import BenchConfig, run_benchmark
from benchmarks.slo import PRESETS, parse_slo
from benchmarks.traces import WorkloadConfig, build_workload
from benchmarks.vllm_metrics import VllmMetricsProbe
from bullet_ray.bench.result import write_json_atomic

logger = logging.getLogger("serve_h100")
REPO = Path(__file__).resolve().parents[2]
BASE_URL = "http://127.0.0.1:8000"
VLLM_URL = "http://127.0.0.1:8001"
GPU_YAML = REPO / "deploy" / "gpu.yaml"
# where a local Ray cluster lists its nodes' metrics export ports (deploy/prometheus.yml reads it too)
RAY_METRICS_DISCOVERY = Path("/tmp/ray/prom_metrics_service_discovery.json")
CAPTURES_METRIC = "ray_bullet_graph_captures_serving"
EXTRA_SUFFIX = "-extra.json"  # runs/<system>-extra.json: what a system recorded, saved when its server stops


def _sh(cmd: str, timeout_s: float = 60) -> str:
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout_s)
    return (proc.stdout + proc.stderr).strip()


# GPU memory (GiB) in use before a system starts above which something else holds the GPU (an idle H100 / H200
# shows ~0.5 GiB; nan, where nvidia-smi is missing, never trips it)
LEFTOVER_GIB = 4.0


def gpu_memory_gib() -> float:
    out = _sh("nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits")
    return float(out.splitlines()[0]) / 1024 if out and out.splitlines()[0].strip().isdigit() else float("nan")


# deploy/gpu.yaml's split policy, dropped from every system's copy (system_yaml): the names set their own
SHIPPED_POLICY_FIELDS = ("split_policy", "ttft_target_ms", "tpot_target_ms", "ttft_margin_ms", "prefill_order",
                         "ttft_fallback_ms")
LT_SUFFIXES = {"lt": "cublaslt", "ltall": "cublaslt-all"}  # engine.prefill_gemm of a bullet system's suffix


def parse_system(system: str) -> tuple[str, str, bool]:
    """(name, engine suffix, is_direct) of an engine system: "chunked-2048+pw1024+direct" ->
    ("chunked-2048", "pw1024", True). At most one engine suffix (+sync, +async, +nopw, +pw<N>, +fixedpw,
    +handoff, +lt, +ltall); "+direct" may come with it, in either order; so may environment suffixes (SUFFIX_ENV:
    +attnoverlap, +attnholistic, +ragged, +paged, +scatter, +vllminit, +directplan; `suffix_env`), each setting a variable once. A system of environment suffixes
    only names the first as its engine suffix."""
    name, *suffixes = system.split("+")
    env = [s for s in suffixes if s in SUFFIX_ENV]
    engine = [s for s in suffixes if s != "direct" and s not in SUFFIX_ENV]
    variables = [v for s in env for v in SUFFIX_ENV[s]]  # two suffixes setting one variable: one would be lost
    if len(engine) > 1 or suffixes.count("direct") > 1 or len(set(variables)) < len(variables):
        raise SystemExit(f"unknown suffixes in {system!r}: one of +sync, +async, +nopw, +pw<tokens>, +fixedpw, "
                         "+handoff, +lt, +ltall, and/or +direct, and/or the environment's "
                         f"{', '.join('+' + s for s in SUFFIX_ENV)} (one per variable)")
    engine = engine or env[:1]
    scheduling = engine[0] if engine else ""
    pw_tokens = scheduling.removeprefix("pw")
    if scheduling not in ("", "sync", "async", "nopw", "fixedpw", "handoff", *LT_SUFFIXES, *SUFFIX_ENV) \
            and not (scheduling.startswith("pw") and pw_tokens.isdigit()):
        raise SystemExit(f"unknown suffix +{scheduling}: +sync, +async, +nopw, +pw<tokens>, +fixedpw, +handoff, "
                         "+lt, +ltall or +direct, and the environment's "
                         f"{', '.join('+' + s for s in SUFFIX_ENV)} (these stack with one of the others)")
    return name, scheduling, "direct" in suffixes


def preset_targets(name: str) -> dict[str, float] | None:
    """The engine's SLO targets for system bullet-slo-<preset>, <preset> an SLO preset of bullet_ray.bench.slo
    other than strict (the engine's default targets already): SLO.engine_targets; None when `name` is not one
    (bullet-slo-late100, bullet-slo-m2)."""
    preset = name.removeprefix("bullet-slo-")
    if preset == name or preset == "strict" or preset not in PRESETS:
        return None
    return PRESETS[preset].engine_targets()


def _numbered(name: str, prefix: str, what: str, least: int = 0) -> int | None:
    """N of a system named <prefix><N>; None for `prefix` alone or another name. SystemExit naming the form when N
    is not an integer >= `least`."""
    text = name.removeprefix(prefix) if name.startswith(prefix) else ""
    if not text:
        return None
    if not text.isdigit() or int(text) < least:
        raise SystemExit(f"unknown system {name!r}: {prefix}<{what}>" + (f", {what} >= {least}" if least else ""))
    return int(text)


# trailing modifiers of a bullet-slo system name: "-bb<tokens>", "-fb<ms>", "-pl<ms>", "-fl<SMs>", "-sat<percent>", "-iw<ms>",
# "-mx<tokens>", "-mc<tokens>", "-dp<pieces>" (and
# "-tf", "-mot", "-ff", "-nogc" below), in any order, each at most once
MODIFIERS = {"bb": ("prefill_backlog_batch_tokens", "tokens"), "fb": ("ttft_fallback_ms", "ms"),
             "dp": ("decode_pieces", "pieces"),
             "pl": ("prefill_plan_lead_ms", "ms"), "fl": ("decode_sm_counts", "SMs"),
             "sat": ("prefill_saturation_share", "percent"), "iw": ("prefill_idle_decide_ms", "ms"),
             "mx": ("mixed_fallback_tokens", "tokens"), "mc": ("mixed_chunk_tokens", "tokens")}
# the modifiers EngineConfig bounds from above: -sat<percent> (a share), -iw<ms> (at most the 0.5 s idle wait)
MODIFIER_MAX = {"sat": 100, "iw": 500}
# ... and from below past 1: -mc<tokens> (a mixed step holds at least one KV block: EngineConfig.block_size, 16),
# -dp<pieces> (one piece is the whole step: the default)
MODIFIER_MIN = {"mc": 16, "dp": 2}
# "-fl<SMs>": the split ladder from that decode floor in steps of 8, up to the default ladder's top (gpu.partition.
# default_ladder on the 132 SMs of the H100 and H200 this script runs on: 16 ... 112): -fl8 -> engine.decode_sm_counts
# [8, 16, ..., 112], prefill up to 124 SMs
GPU_SMS, LADDER_STEP = 132, 8


def floor_ladder(floor: int) -> list[int]:
    """The decode SM counts of a "-fl<floor>" system: floor, floor + 8, ... up to the default ladder's top."""
    from bullet_ray.gpu.partition import default_ladder

    top = default_ladder(GPU_SMS, LADDER_STEP)[-1]
    if floor % LADDER_STEP or not LADDER_STEP <= floor <= top:
        raise SystemExit(f"-fl{floor}: the decode SM floor must be a multiple of {LADDER_STEP} in [{LADDER_STEP}, {top}]")
    return list(range(floor, top + 1, LADDER_STEP))
# and "-tf": the split rule's BALANCE keeps decode at its TPOT target (split_rule.balance: tpot_first); "-mot": the
# prefill queue keeps only the most requests that make their TTFT targets together (prefill_order: max_on_time);
# "-ff": the most that make the fallback target together, as many of them as can their own (prefill_order:
# fallback_first; with -fb<ms>); "-nogc": the workers' heaps are not frozen once started (engine.gc_freeze: false; the
# engine's default since the fifty-first session freezes them)
FLAG_MODIFIERS: dict[str, tuple[str, Any]] = {"tf": ("split_rule", {"balance": "tpot_first"}),
                                              "mot": ("prefill_order", "max_on_time"),
                                              "ff": ("prefill_order", "fallback_first"),
                                              "nogc": ("gc_freeze", False)}


def _modifiers(name: str) -> tuple[str, dict[str, Any]]:
    """(the system without them, the engine fields they set) for a bullet-slo system with trailing "-bb<N>" (its
    prefill batches grow to N tokens while the split rule sees a backlog: engine.prefill_backlog_batch_tokens) and/or
    "-fb<ms>" (a late request is still ordered to make a fallback TTFT target of <ms>: engine.ttft_fallback_ms)
    and/or "-pl<ms>" (the prefill worker plans its next batch <ms> before the step in flight is predicted to end,
    reading arrivals meanwhile: engine.prefill_plan_lead_ms, bullet-slo-late<ms>'s field beside another policy)
    and/or "-fl<SMs>" (the split ladder from that decode SM floor: engine.decode_sm_counts, floor_ladder)
    and/or "-sat<percent>" (a prefill batch stops growing within that share of the best throughput:
    engine.prefill_saturation_share, percent / 100; the engine's default 95)
    and/or "-iw<ms>" (while prefill idles and decode runs, the split decided again every <ms>:
    engine.prefill_idle_decide_ms)
    and/or "-mx<tokens>" (the mixed fallback beside any policy: once that many prompt tokens wait while decode runs,
    the decode worker prefills the queued prompts in chunks inside its steps on the whole GPU:
    engine.mixed_fallback_tokens, bullet-slo-mixed<tokens>'s field) and/or "-mc<tokens>" (that fallback's step budget,
    decode rows and prompt chunks: engine.mixed_chunk_tokens, 2,048 by default)
    and/or "-dp<pieces>" (decode steps as that many CUDA graphs of layers, launched just in time, the split followed
    between them: engine.decode_pieces)
    and/or "-tf" (engine.split_rule.balance: tpot_first) and/or "-mot" (engine.prefill_order: max_on_time) or "-ff"
    (engine.prefill_order: fallback_first) and/or "-nogc" (engine.gc_freeze: false); (name, {})
    for any other name:
    "bullet-slo-margin50-bb8192" -> ("bullet-slo-margin50", {..._tokens: 8192})."""
    base, fields = name, dict[str, Any]()
    while True:
        head, sep, tail = base.rpartition("-")
        if sep and tail in FLAG_MODIFIERS and head.startswith("bullet-slo"):
            field, value = FLAG_MODIFIERS[tail]
            if field in fields:
                other = field == "prefill_order" and fields[field] != value  # -mot beside -ff
                raise SystemExit(f"unknown system {name!r}: " + ("-mot and -ff each set the prefill order: give one "
                                                                 "of them" if other else f"-{tail} at most once"))
            fields[field], base = (dict(value) if isinstance(value, dict) else value), head
            continue
        kind = next((k for k in MODIFIERS if tail.startswith(k)), None)
        if not sep or kind is None or not head.startswith("bullet-slo"):
            return base, fields
        field, unit = MODIFIERS[kind]
        number = tail[len(kind):]
        most, least = MODIFIER_MAX.get(kind), MODIFIER_MIN.get(kind, 1)
        if field in fields or not number.isdigit() or int(number) < least or (most is not None and int(number) > most):
            raise SystemExit(f"unknown system {name!r}: <bullet-slo system>[-bb<tokens>][-fb<ms>][-pl<ms>][-fl<SMs>]"
                             f"[-sat<percent>][-iw<ms>][-mx<tokens>][-mc<tokens>][-dp<pieces>][-tf][-mot|-ff][-nogc], each once, "
                             f"{unit} >= {least}"
                             + (f", <= {most}" if most is not None else ""))
        fields[field] = int(number) / 100 if kind == "sat" else int(number)
        base = head


def system_yaml(system: str, out_dir: Path, base_yaml: Path = GPU_YAML) -> Path:
    """Copies of deploy/gpu.yaml without its split policy (SHIPPED_POLICY_FIELDS), prefill_gemm pinned to cublas
    unless "+lt" / "+ltall": otherwise as shipped for "bullet" (the engine's default fixed split), with the SLO split policy for "bullet-slo"
    (aimed at a preset of bullet_ray.bench.slo for "bullet-slo-<preset>": preset_targets), and with schedule chunked and the token budget
    for chunked-<n>; a "+sync" / "+async" suffix sets async_scheduling off / on (else the engine's
    default), "+nopw" turns piecewise graphs off (steps with prompt tokens run eagerly, as before the fifth
    session), "+fixedpw" the fixed piecewise token buckets (piecewise_buckets: fixed, before the twentieth session's
    tuned ones), "+pw<N>" sets piecewise_graph_tokens to N (chunked-2048+pw1024: the sixth session's chunked
    schedule, whose steps with prompt tokens, up to 2,048, were collected before the launch), "+handoff" sends
    prefilled sequences from the prefill worker to the decode worker directly (engine.handoff: direct), "+lt" / "+ltall"
    the prefilling worker's projections through the cuBLASLt algorithms tuned per partition, or on the whole GPU for
    chunked (engine.prefill_gemm: cublaslt / cublaslt-all; every other system pins cublas). Every system pins
    engine.prefill_plan_lead_ms: null unless bullet-slo-late<ms> or -pl<ms> sets it. "+direct"
    changes nothing in the YAML (serve_run sets direct ingress in `serve run`'s environment) but names the copy and the
    step log apart."""
    name, scheduling, _ = parse_system(system)
    suffix = system[len(name):]  # every suffix, "+direct" included: the file names of two systems never meet
    doc = yaml.safe_load(base_yaml.read_text())
    engine = doc["applications"][0]["args"]["engine"]
    # PyTorch's cuBLAS GEMMs unless "+lt" / "+ltall": the engine's default (auto) tunes cuBLASLt on a bullet prefill
    # worker since the thirtieth session, and a system's name keeps meaning what it measured in the runs before
    engine["prefill_gemm"] = LT_SUFFIXES.get(scheduling, "cublas")
    # the shipped YAML's split policy (slo, strict targets, a 50 ms margin since the thirty-first session, the
    # max_on_time prefill order since the thirty-third) goes:
    # each system's name states its own below, "bullet" the engine's default fixed split, as in the runs before
    for key in SHIPPED_POLICY_FIELDS:
        engine.pop(key, None)
    # likewise the plan lead (the engine's default 10 ms since the thirty-first session): none unless
    # bullet-slo-late<ms> or -pl<ms> sets one below
    engine["prefill_plan_lead_ms"] = None
    if scheduling == "nopw":
        engine["piecewise_graph_tokens"] = 0
    elif scheduling == "fixedpw":
        engine["piecewise_buckets"] = "fixed"
    elif scheduling.startswith("pw"):
        engine["piecewise_graph_tokens"] = int(scheduling.removeprefix("pw"))
    elif scheduling == "handoff":
        engine["handoff"] = "direct"
    elif scheduling in ("sync", "async"):  # (+attn<mode> is `serve run`'s environment: SUFFIX_ENV)
        engine["async_scheduling"] = scheduling == "async"
    policy, modifiers = _modifiers(name)  # "bullet-slo-margin50-bb8192" -> ("bullet-slo-margin50", {...: 8192})
    targets = preset_targets(policy)
    if policy in ("bullet-slo", "bullet-slo-m2", "bullet-slo-overlap", "bullet-slo-disjoint") or targets is not None \
            or policy.startswith(("bullet-slo-lw", "bullet-slo-late", "bullet-slo-margin", "bullet-slo-omargin",
                                "bullet-slo-mixed")):
        engine["split_policy"] = "slo"  # targets: the strict preset (EngineConfig's defaults, 500 ms / 25 ms) ...
        if targets is not None:  # ... but bullet-slo-<preset>'s here (a preset name is never one of the below)
            engine.update(targets)
        if policy == "bullet-slo-m2":  # the split rule of the m2 runs: no BACKLOG rule, idle decode at its fastest
            engine["split_rule"] = {"backlog_aim": None, "idle_decode": "fastest"}
        if policy == "bullet-slo-overlap":  # each side moves to a new split at its next launch (docs/policy.md)
            engine["split_switch"] = "overlap"  # the default since the eighteenth session; named for the A/B
        if policy == "bullet-slo-disjoint":  # the shrinking side finishes its step in flight before it acks
            engine["split_switch"] = "disjoint"
        groups = _numbered(policy, "bullet-slo-lw", "groups", least=2)
        if groups is not None:  # layer-wise prefill: every prefill batch of >= 256 tokens in <groups> layer groups
            engine["prefill_layer_groups"] = groups
            engine["prefill_layer_group_min_tokens"] = 256
        lead = _numbered(policy, "bullet-slo-late", "ms")
        if lead is not None:  # the prefill side plans its next batch <lead> ms before the step in flight ends
            if "prefill_plan_lead_ms" in modifiers:
                raise SystemExit(f"unknown system {system!r}: bullet-slo-late<ms> sets the plan lead already; "
                                 "-pl<ms> goes with another policy")
            engine["prefill_plan_lead_ms"] = lead
        margin = _numbered(policy, "bullet-slo-margin", "ms")
        if margin is not None:  # the policy plans as if each TTFT target were <margin> ms shorter
            engine["ttft_margin_ms"] = margin  # scope: the engine's default, all (the YAML of the measured runs)
        order_margin = _numbered(policy, "bullet-slo-omargin", "ms")
        if order_margin is not None:  # the same, in the queue's order and the batches' fit only
            engine["ttft_margin_ms"] = order_margin
            engine["ttft_margin_scope"] = "order"
        mixed = _numbered(policy, "bullet-slo-mixed", "tokens", least=1)
        if mixed is not None:  # the decode worker takes the queued prompts once <mixed> prompt tokens wait
            if "mixed_fallback_tokens" in modifiers:
                raise SystemExit(f"unknown system {system!r}: bullet-slo-mixed<tokens> sets the mixed fallback "
                                 "already; -mx<tokens> goes with another policy")
            engine["mixed_fallback_tokens"] = mixed
        if "mixed_chunk_tokens" in modifiers and "mixed_fallback_tokens" not in engine \
                and "mixed_fallback_tokens" not in modifiers:
            raise SystemExit(f"unknown system {system!r}: -mc<tokens> sizes the mixed fallback's steps: "
                             "give -mx<tokens> (or bullet-slo-mixed<tokens>) too")
        if modifiers.get("prefill_order") == "fallback_first" and "ttft_fallback_ms" not in modifiers:
            raise SystemExit(f"unknown system {system!r}: -ff orders by the fallback TTFT target: give -fb<ms> too "
                             "(e.g. -ff-fb1000)")
        rule = modifiers.pop("split_rule", None)
        if rule is not None:  # -tf: beside bullet-slo-m2's own settings
            engine["split_rule"] = {**engine.get("split_rule", {}), **rule}
        if "decode_sm_counts" in modifiers:  # -fl<SMs>: the ladder from that floor
            modifiers["decode_sm_counts"] = floor_ladder(modifiers["decode_sm_counts"])
        engine.update(modifiers)  # -bb<tokens>, -fb<ms>, -pl<ms>, -fl<SMs>, -sat<percent>, -iw<ms>, -mx, -mc, -dp, -mot, -ff, -nogc
        # every worker step and split decision, for predicted-vs-measured accuracy and the split-over-time plot
        engine["step_log_path"] = str((out_dir / f"{name}{suffix}-steps.jsonl").resolve())
    elif name != "bullet":
        schedule, _, budget = name.partition("-")
        if schedule not in ("chunked", "static") or (budget and not budget.isdigit()):
            presets = "|".join(p for p in PRESETS if p != "strict")
            raise SystemExit(f"unknown system {name!r}: bullet, bullet-slo[-lw<groups>|-late<ms>|-margin<ms>|"
                             f"-omargin<ms>|-mixed<tokens>|-m2|-overlap|-disjoint|-<SLO preset: {presets}>][-bb<tokens>][-fb<ms>][-pl<ms>][-fl<SMs>]"
                             f"[-sat<percent>][-iw<ms>][-mx<tokens>][-mc<tokens>][-dp<pieces>][-tf][-mot|-ff][-nogc], "
                             f"chunked-<tokens> or static[-<tokens>]")
        engine["schedule"] = schedule
        if budget:
            engine["max_num_batched_tokens"] = int(budget)
        if schedule == "chunked":  # the hybrid worker's steps (phase, tokens, device and host time)
            engine["step_log_path"] = str((out_dir / f"{name}{suffix}-steps.jsonl").resolve())
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}{suffix}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@contextlib.contextmanager
def serve_run(system: SystemSpec, out_dir: Path) -> Iterator[None]:
    """`serve run <yaml>` (it starts a local Ray cluster, as a user's first run does); stopped after. For a
    "+direct" system, `serve run` gets RAY_SERVE_ENABLE_DIRECT_INGRESS=1 and `system.base_url` becomes the
    replica's own HTTP address once it runs (benchmarks.direct_ingress), recorded in extra["direct_ingress"]."""
    path = system_yaml(system.name, out_dir, Path(system.extra.get("base_yaml", GPU_YAML)))
    system.extra["yaml"] = str(path.relative_to(REPO) if path.is_relative_to(REPO) else path.name)
    system.extra["command"] = f"serve run {system.extra['yaml']}"
    out_dir.mkdir(parents=True, exist_ok=True)
    # a server left by an earlier call would answer this sweep or hold the GPU (vLLM's port: on the GPU machine's
    # default addresses only, not where a test serves a copy of deploy/local.yaml on its own port)
    for url in (system.base_url, VLLM_URL) if system.base_url == BASE_URL else (system.base_url,):
        refuse_if_answering(system.name, url)
    idle_gib = gpu_memory_gib()
    if idle_gib > LEFTOVER_GIB:
        raise RuntimeError(f"{idle_gib:.1f} GiB of GPU memory in use before {system.name} was started: a process "
                           "left by an earlier run? (nvidia-smi; ray stop --force)")
    started = time.monotonic()
    is_direct = parse_system(system.name)[2]
    with open(out_dir / f"{system.name}-serve.log", "ab") as log:
        env = serve_run_env(system.extra.get("serve_env", {}), is_direct)
        proc = subprocess.Popen(["serve", "run", str(path)], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)
        track_group(proc.pid, signal.SIGINT)  # Ctrl-C: serve run shuts Serve and its Ray cluster down
        try:
            if is_direct:  # the replica's own HTTP port, known once it runs; run_comparison reads base_url after
                app_name = yaml.safe_load(path.read_text())["applications"][0]["name"]
                system.base_url = direct_ingress.find_replica_url(app_name, system.ready_timeout_s, proc)
                system.extra["direct_ingress"] = {"env": f"{direct_ingress.ENV_VAR}=1", "base_url": system.base_url}
                logger.info("%s: direct ingress at %s", system.name, system.base_url)
            wait_ready(system.base_url, system.ready_timeout_s, proc)
            _wait_generates(system.base_url, system.ready_timeout_s)
            system.extra["ready_s"] = round(time.monotonic() - started, 1)
            system.extra["gpu_memory_gib_serving"] = round(gpu_memory_gib(), 2)
            logger.info("%s ready in %.0f s", system.name, system.extra["ready_s"])
            if system.name == "bullet" and system.extra.get("check_requests"):
                for attempt in ("serve_check_first", "serve_check"):  # the first batch meets cold graphs
                    system.extra[attempt] = serve_check(system.base_url, system.extra["check_requests"],
                                                        system.extra["check_prompt_tokens"])
            yield
            system.extra["graph_captures_serving"] = graph_captures_serving()
            gc = engine_gc(system.base_url)  # the front's and the workers' garbage collections over the whole run
            if gc is not None:
                system.extra["gc"] = gc
            steps = out_dir / f"{system.name}-steps.jsonl"
            if steps.is_file():  # a bullet system's split switches (to both acks and to the drain) and hand-offs
                from benchmarks.plot_steps import (
                    handoff_summary,
                    prefill_gemm_summary,
                    records,
                    startup_summary,
                    switch_summary,
                )

                recs = records(str(steps))
                summary = switch_summary(recs)
                if summary is not None:
                    system.extra["switches"] = summary
                handoffs = handoff_summary(recs)
                if handoffs:
                    system.extra["handoffs"] = handoffs
                startup = startup_summary(recs)  # where the workers' part of ready_s went
                if startup:
                    system.extra["startup"] = startup
                gemm = prefill_gemm_summary(recs)  # +lt: what the tuning kept, by partition size
                if gemm:
                    system.extra["prefill_gemm"] = gemm
        finally:
            _stop(proc, idle_gib)
            untrack_group(proc.pid)
            system.extra["gpu_memory_gib_after_shutdown"] = round(gpu_memory_gib(), 2)
            # kept beside the run files: a call cut short before compare.json keeps what each finished system
            # recorded (start-up, switches, memory), which `--merge` of its folder reads back
            write_json_atomic(out_dir / "runs" / f"{system.name}{EXTRA_SUFFIX}", system.extra)


def graph_captures_serving(discovery: Path = RAY_METRICS_DISCOVERY, timeout_s: float = 5.0) -> int | None:
    """CUDA graphs the engines captured after start (`ray_bullet_graph_captures_serving`, summed over the
    engines) as every node of the local Ray cluster last exported it (Ray exports every ~10 s, so a capture in
    the sweep's last seconds may not be in it yet); issue 12 wants 0. None when no node's port answered or none
    exported the gauge."""
    from bullet_ray.control.readings import scrape_samples

    try:
        groups = json.loads(discovery.read_text())
    except (OSError, ValueError):
        return None
    urls = [f"http://{target}/metrics" for group in groups for target in group.get("targets", [])]
    values = scrape_samples(urls, lambda name, _: name == CAPTURES_METRIC, timeout_s)
    return int(sum(values.values())) if values else None


def engine_gc(base_url: str, timeout_s: float = 10.0) -> dict[str, Any] | None:
    """The engine's Python garbage collections since it started, as `/v1/internal/stats` gives them (`gc`: seconds
    and collections per process, the front and each worker, and the front's frozen-object count); read at a
    system's end. None when the route does not answer or has no such entry."""
    import requests  # type: ignore[import-untyped]

    try:
        r = requests.get(f"{base_url}/v1/internal/stats", timeout=timeout_s)
        r.raise_for_status()
        gc = r.json().get("gc")
    except (requests.RequestException, ValueError, AttributeError):
        return None
    return gc if isinstance(gc, dict) else None


def _wait_generates(base_url: str, timeout_s: float) -> None:
    """Until a one-token completion succeeds (the ingress answers /health before the engines are up)."""
    import requests  # type: ignore[import-untyped]

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = requests.post(f"{base_url}/v1/completions", json={"prompt": [1000, 1001], "max_tokens": 1},
                              timeout=timeout_s)
            if r.status_code == 200:
                return
            logger.info("not generating yet: %s %s", r.status_code, r.text[:200])
        except requests.RequestException as e:
            logger.info("not generating yet: %s", e)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{base_url} did not generate within {timeout_s:.0f} s")
        time.sleep(2)


def _stop(proc: subprocess.Popen, idle_gib: float) -> None:
    """Ctrl-C to `serve run` (it shuts Serve and its local Ray down); wait until the GPU memory is idle again."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=90)
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and gpu_memory_gib() > idle_gib + 1.0:
        time.sleep(1)
    if gpu_memory_gib() > idle_gib + 1.0:  # a worker outlived its cluster: the GPU is needed for the next system
        logger.warning("GPU memory still in use after serve run stopped; ray stop --force")
        _sh("ray stop --force", timeout_s=120)


def vllm_command(model_dir: str = "/tmp/llama8b", port: int = 8001, max_model_len: int = 16384) -> str:
    """Write the dummy model folder, then `vllm serve` it with vLLM's own packages first on the path ($VLLM_SITE,
    kept apart from Ray's and flashinfer's, which bring other fastapi/pydantic/flashinfer versions)."""
    site = os.environ.get("VLLM_SITE", "/tmp/vsite")
    env = f"env PYTHONPATH={site}:{REPO} PATH={site}/bin:$PATH"
    return (f"{env} python3 -m benchmarks.gpu.vllm_model {model_dir} && exec {env} python3 -m "
            f"vllm.entrypoints.openai.api_server --model {model_dir} --load-format dummy --dtype bfloat16 "
            f"--max-model-len {max_model_len} --port {port} --seed 0 --no-enable-prefix-caching")


def vllm_version() -> str:
    site = os.environ.get("VLLM_SITE", "/tmp/vsite")
    return _sh(f"PYTHONPATH={site} python3 -c 'import vllm; print(vllm.__version__)' 2>&1 | tail -1", timeout_s=120)


# environment an engine suffix sets for `serve run` (the engine replicas and their workers inherit it)
SUFFIX_ENV = ENGINE_VARIANTS


def suffix_env(system: str) -> dict[str, str]:
    """The environment a system's suffixes set for `serve run` (SUFFIX_ENV of each, in order)."""
    env: dict[str, str] = {}
    for suffix in system.split("+")[1:]:
        env.update(SUFFIX_ENV.get(suffix, {}))
    return env


# Serve's direct ingress keeps a stopping replica this long (default 30 s) so that a load balancer can stop routing
# to it; a benchmark's `serve run` has none, and Ctrl-C waited the whole period before the next system could start
# (CPU, deploy/local.yaml under RAY_SERVE_THROUGHPUT_OPTIMIZED=1: 32.5 s to exit, 4.5 s with this at 1 s: results/serve_stop_cpu/)
STOP_ENV = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1"}


def serve_run_env(serve_env: dict[str, str], is_direct: bool) -> dict[str, str]:
    """`serve run`'s environment: STOP_ENV, then this process's, then the system's (--serve-env and its suffix);
    with direct ingress on, the switch the Serve controller and replicas of the cluster it starts read."""
    env = {**STOP_ENV, **os.environ, **serve_env}
    if is_direct:
        env[direct_ingress.ENV_VAR] = "1"
    return env


def make_system(name: str, args: argparse.Namespace) -> SystemSpec:
    if name == "vllm":
        return SystemSpec(name, VLLM_URL, launch=vllm_command(), ready_timeout_s=args.ready_timeout_s,
                          extra={"command": vllm_command(), "version": vllm_version(), "prefix_caching": False},
                          probe=VllmMetricsProbe(f"{VLLM_URL}/metrics"))
    return SystemSpec(name, BASE_URL, lifecycle=serve_run, ready_timeout_s=args.ready_timeout_s,
                      extra={"base_yaml": str(args.base_yaml.resolve()), "check_requests": args.check_requests,
                             "check_prompt_tokens": args.check_prompt_tokens,
                             "serve_env": {**args.serve_env, **suffix_env(name)}})


def serve_check(base_url: str, num_requests: int = 64, prompt_tokens: int = 1024) -> dict[str, Any]:
    """A batch of concurrent streaming completions (`prompt_tokens` each, 128 forced output tokens), and
    one greedy gRPC call compared with the same request over HTTP."""
    workload = WorkloadConfig(dataset="random", num_prompts=num_requests, random_input_tokens=prompt_tokens,
                              random_output_tokens=128, random_distribution="fixed", seed=1)
    config = BenchConfig(base_url=base_url, workload=workload, slos=["relaxed", "strict"], label="bullet-batch")
    result = asyncio.run(run_benchmark(config, build_workload(workload)))
    s = result.summary
    check: dict[str, Any] = {
        "requests": num_requests, "prompt_tokens_each": prompt_tokens, "output_tokens_each": 128, "all_at_once": True,
        "completed": s["num_completed"], "failed": s["num_failed"],
        "output_length_mismatches": s["num_output_length_mismatch"],
        "total_output_tokens": s["total_output_tokens"], "duration_s": round(s["duration_s"], 2),
        "output_tokens_per_s": round(s["output_throughput_tps"], 1),
        "ttft_ms": s["ttft_ms"], "tpot_ms": s["tpot_ms"], "itl_ms": s["itl_ms"],
    }
    check["grpc"] = grpc_check(base_url)
    check["gpu_memory_gib"] = round(gpu_memory_gib(), 2)
    check["mps_servers"] = _sh("echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/tmp/bullet_ray/mps/bullet_ray/pipe "
                               "nvidia-cuda-mps-control")
    return check


def grpc_check(base_url: str) -> dict[str, Any]:
    import grpc
    import requests  # type: ignore[import-untyped]

    from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
    from bullet_ray.serve.proto.generate_pb2_grpc import GeneratorStub

    ids = list(range(1000, 1256))
    http = requests.post(f"{base_url}/v1/completions", json={"prompt": ids, "max_tokens": 32, "temperature": 0,
                                                           "ignore_eos": True}, timeout=120).json()
    chunks: list[str] = []
    with grpc.insecure_channel("127.0.0.1:9000") as channel:
        request = GenerateRequest(prompt_token_ids=ids, max_tokens=32, temperature=0.0, ignore_eos=True)
        for response in GeneratorStub(channel).Generate(request, metadata=[("application", "bullet")], timeout=120):
            chunks.append(response.text)
    http_text = http["choices"][0]["text"]
    return {"grpc_text_equals_http": "".join(chunks) == http_text, "num_grpc_messages": len(chunks),
            "http_completion_tokens": http["usage"]["completion_tokens"]}


def systems_from_runs(folder: Path, slo_names: list[str]) -> dict[str, Any]:
    """compare.json's `systems` rebuilt from a sweep's run files (`folder`/runs/<system>-rate<R>.json, or
    .json.gz as saved under benchmarks/results/), for a sweep cut short after its last rate but before it
    wrote compare.json; each system's `extra` from runs/<system>-extra.json[.gz] where its server was stopped
    before the cut."""
    from benchmarks.rescore import RUN_FILE_NAME, load_run
    from benchmarks.slo import goodput

    systems: dict[str, Any] = {}
    seen: dict[tuple[str, float], Path] = {}
    for path in sorted(p for p in (folder / "runs").iterdir() if RUN_FILE_NAME.match(p.name)):
        try:
            run = load_run(path)
        except (OSError, ValueError, EOFError) as e:  # a file cut short by a kill mid-write (before atomic saves)
            raise SystemExit(f"--merge: {path}: cannot read: {type(e).__name__}: {e}") from e
        name, rate = run["config"]["label"], run["config"]["workload"]["rate_rps"]
        if (name, rate) in seen:
            raise SystemExit(f"--merge: {path.name} and {seen[name, rate].name} are both {name} at {rate:g} req/s")
        seen[name, rate] = path
        entry = systems.setdefault(name, {"base_url": run["config"]["base_url"], "launch": None, "extra": {},
                                          "points": [], "error": None})
        entry["points"].append({"rate_rps": rate, "rate": rate, "summary": run["summary"],
                                "result_file": str(path.relative_to(folder))})
    for name, entry in systems.items():
        for extra in (folder / "runs" / f"{name}{EXTRA_SUFFIX}", folder / "runs" / f"{name}{EXTRA_SUFFIX}.gz"):
            if extra.is_file():
                entry["extra"] = load_run(extra)
        entry["points"].sort(key=lambda p: p["rate_rps"])
        entry["goodput"] = {n: goodput([(p["rate_rps"], p["summary"]["slo"][n]["attainment"])
                                        for p in entry["points"]], n).to_dict() for n in slo_names}
    return systems


def merge(paths: list[Path], out: Path) -> dict[str, Any]:
    """One table and one figure from several compare.json files made with the same workload; a folder in
    `paths` instead of a compare.json is a sweep cut short before it wrote one (its systems rebuilt from
    its run files, `systems_from_runs`). A system in several files (more rates swept in a later call) keeps
    the first file's points and adds the other rates; its goodput is computed again over all of them."""
    files = [p for p in paths if not p.is_dir()]
    if not files:
        raise SystemExit("--merge needs at least one compare.json (for the workload and the SLOs)")
    docs = [json.loads(p.read_text()) for p in files]
    doc = docs[0]
    names = [slo["name"] for slo in doc["slos"]]
    docs += [{"systems": systems_from_runs(p, names)} for p in paths if p.is_dir()]
    from benchmarks.slo import goodput

    for other in docs[1:]:
        for name, entry in other["systems"].items():
            mine = doc["systems"].get(name)
            if mine is None:
                doc["systems"][name] = entry
                continue
            # the same system swept at more rates in another call (same lease): its points joined, goodput redone
            rates = {p["rate_rps"] for p in mine["points"]}
            mine["points"] = sorted(mine["points"] + [p for p in entry["points"] if p["rate_rps"] not in rates],
                                    key=lambda p: p["rate_rps"])
            mine["goodput"] = {n: goodput([(p["rate_rps"], p["summary"]["slo"][n]["attainment"])
                                           for p in mine["points"]], n).to_dict() for n in names}
            mine["error"] = mine.get("error") or entry.get("error")  # a failed later sweep stays visible
        doc.setdefault("runs", []).extend(other.get("runs", []))
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(doc, indent=1))
    (out / "compare.md").write_text(comparison_markdown(doc) + "\n")
    primary = doc["slo"]["name"]
    devices = {str(run.get("device", "")).split(",")[0] for run in doc.get("runs", [])} - {""}
    device = " + ".join(sorted(devices)) or "GPU"  # nvidia-smi's name of the machine(s) the runs came from
    for slo in doc["slos"]:  # compare.png for the primary SLO, compare-<name>.png for the others
        name = slo["name"]
        report.plot_sweep({n: e["points"] for n, e in doc["systems"].items()}, name,
                          out / ("compare.png" if name == primary else f"compare-{name}.png"),
                          {n: e["goodput"][name] for n, e in doc["systems"].items()},
                          title=f"{device}, dummy Llama-3.1-8B, {doc['config']['workload']['dataset']} lengths, Poisson; "
                                f"SLO {parse_slo(name).describe()}")
    return doc


def write_intervals(out: Path, slo_names: list[str]) -> None:
    """goodput_ci.{json,txt} beside compare.md: bootstrap intervals of every system's goodput and of every ratio
    (benchmarks.goodput_ci), from the run files in out/runs/ (none there, as in a merge's folder: nothing)."""
    from benchmarks import goodput_ci

    if (out / "runs").is_dir():
        goodput_ci.main([str(out), "--slo", ",".join(slo_names), "--goal", "1.2,1.25", "--no-progress",
                         "--out", str(out / "goodput_ci.json")])


def bench_config(args: argparse.Namespace) -> BenchConfig:
    """The client's settings for every system of the sweep: the workload (dataset, requests per rate, seed), the
    SLOs, two warm-up requests."""
    workload = WorkloadConfig(dataset=args.dataset, num_prompts=args.num_prompts, seed=args.seed,
                              trace_path=args.trace_path)
    return BenchConfig(base_url=BASE_URL, workload=workload, slos=args.slo.split(","), warmup_requests=2)


def serve_env_of(items: list[str]) -> dict[str, str]:
    """--serve-env's KEY=VALUE pairs as a dict (ValueError naming the first item that is not one)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key or not sep:
            raise ValueError(f"give KEY=VALUE, got {item!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="bullet,chunked-1024,chunked-2048",
                        help="comma-separated: bullet (fixed split), bullet-slo (the SLO split policy), "
                             "bullet-slo-lw<G> (and layer-wise prefill in G groups), bullet-slo-late<ms> (the "
                             "prefill side plans <ms> before its step in flight ends), bullet-slo-margin<ms> (the "
                             "policy plans for each TTFT target <ms> shorter: order, batch fit and split rule), "
                             "bullet-slo-omargin<ms> (the same in the order and batch fit only; the split rule "
                             "keeps the real targets), <bullet-slo system>-bb<tokens> (its prefill batches grow "
                             "to <tokens> under a backlog), -fb<ms> (late requests ordered for a fallback "
                             "TTFT target of <ms>), -pl<ms> (the prefill side plans <ms> before its step in "
                             "flight ends), -fl<SMs> (the split ladder from that decode SM floor: decode_sm_counts), "
                             "-sat<percent> (prefill batches stop growing within that share of the best "
                             "throughput: prefill_saturation_share), -iw<ms> (an idle prefill side decides the "
                             "split every <ms> while decode runs: prefill_idle_decide_ms), -mx<tokens> (the mixed fallback "
                             "from <tokens> waiting prompt tokens beside any policy but bullet-slo-mixed<tokens>: mixed_fallback_tokens) with "
                             "-mc<tokens> (its step budget: mixed_chunk_tokens), "
                             "-tf (BALANCE keeps decode at its TPOT target: "
                             "split_rule.balance tpot_first) and/or -mot (the queue keeps the most requests that "
                             "make their targets together: prefill_order max_on_time) or -ff (the most that make the -fb "
                             "target, as many of them as can their own: prefill_order fallback_first), -nogc (the "
                             "workers' heaps not frozen once started: gc_freeze false), "
                             "bullet-slo-mixed<tokens> (the "
                             "mixed fallback from <tokens> waiting prompt tokens), bullet-slo-m2 (the m2 split "
                             "rule), bullet-slo-overlap (split switches without waiting for the other side, the "
                             "default), bullet-slo-disjoint (a side gives up SMs only after its step in flight), "
                             "bullet-slo-<preset> (aimed at an SLO preset but strict: "
                             f"{', '.join(p for p in PRESETS if p != 'strict')}), chunked-<tokens>, static[-<tokens>], "
                             "vllm (`vllm serve` from $VLLM_SITE; its /metrics read around each rate); an engine "
                             "system + '+sync' / '+async' sets async_scheduling off / on, + '+nopw' piecewise graphs off, "
                             "+ '+fixedpw' the fixed piecewise buckets, + '+attnoverlap' a mixed step's two attention "
                             "kernels at once (BULLET_RAY_MIXED_ATTENTION=overlap), + '+attnholistic' every row of a "
                             "mixed step in one persistent kernel (BULLET_RAY_MIXED_ATTENTION=holistic), + '+ragged' "
                             "prompts that start in a step through the ragged prefill (BULLET_RAY_PREFILL_ATTENTION="
                             "ragged, the engine's default), + '+paged' every prompt row through the paged prefill "
                             "(BULLET_RAY_PREFILL_ATTENTION=paged), + '+scatter' the K/V write by index_put_ "
                             "(BULLET_RAY_KV_WRITE=scatter), + '+vllminit' dummy weights drawn as vLLM's dummy loader "
                             "draws them (BULLET_RAY_DUMMY_INIT=uniform), + '+directplan' decode graphs planned by "
                             "flashinfer's compiled planner directly (BULLET_RAY_DECODE_PLAN=direct): these seven set "
                             "`serve run`'s environment and combine with the other suffixes, "
                             "+ '+pw<N>' piecewise graphs up to N tokens, + '+handoff' (bullet systems) the direct "
                             "prefill -> decode hand-off, + '+lt' / '+ltall' the prefilling worker's GEMMs through "
                             "cuBLASLt algorithms tuned per partition or whole GPU (one of these), and/or + '+direct': Ray "
                             "Serve's direct ingress (chunked-2048+direct, chunked-2048+pw1024+direct)")
    parser.add_argument("--rates", default="4,8,12,16", help="Poisson request rates to sweep (req/s)")
    parser.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    parser.add_argument("--seed", type=int, default=0,
                        help="the workload's seed (arrivals and prompts; each rate's prompts stay distinct): another "
                             "seed is another sample of the same workload, for the spread between runs")
    parser.add_argument("--slo", default="relaxed,strict", help="SLO presets; the first decides goodput")
    parser.add_argument("--ready-timeout-s", type=float, default=420.0)
    parser.add_argument("--base-yaml", type=Path, default=GPU_YAML,
                        help="the YAML of system 'bullet'; the others are copies of it (deploy/local.yaml tries "
                             "this script on a CPU)")
    parser.add_argument("--check-requests", type=int, default=64,
                        help="concurrent streaming requests sent to 'bullet' before its sweep (0: none)")
    parser.add_argument("--check-prompt-tokens", type=int, default=1024)
    parser.add_argument("--trace-path", default=str(REPO.parent / "shared" / "data" / "azure-llm-inference-2023"),
                        help="the Azure trace folder (or conv.csv)")
    parser.add_argument("--dataset", default="azure-conv", choices=("azure-conv", "azure-code"),
                        help="which Azure 2023 trace's prompt/output lengths")
    parser.add_argument("--serve-env", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                        help="environment of our systems' `serve run` (one or more pairs, the flag repeatable), e.g. "
                             "RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (it turns Serve's direct ingress on too: give such "
                             "systems '+direct' so that the sweep goes to the replica's port, not 8000)")
    parser.add_argument("--merge", nargs="+", type=Path, help="merge these compare.json files (or folders of sweeps cut short: their runs/) into --out")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "benchmarks/results/serve_h100")))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.merge:
        doc = merge(args.merge, args.out)
        print((args.out / "compare.md").read_text())
        write_intervals(args.out, [slo["name"] for slo in doc["slos"]])
        return 0

    try:
        args.serve_env = serve_env_of(args.serve_env)
    except ValueError as e:
        parser.error(f"--serve-env: {e}")
    systems = [make_system(n, args) for n in args.systems.split(",") if n]
    base = bench_config(args)
    stop_on_sigterm()  # a call's time limit (timeout's SIGTERM) still stops serve run and vllm serve
    doc = run_comparison(systems, base, args.out, rates=[float(r) for r in args.rates.split(",")], plot=True)
    doc["runs"] = [{"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "command": "python -m benchmarks.gpu.serve_h100 " + " ".join(sys.argv[1:] if argv is None else argv),
                    "device": _sh("nvidia-smi --query-gpu=name,driver_version --format=csv,noheader"),
                    "systems": [s.name for s in systems],
                    "extra": {s.name: s.extra for s in systems}}]
    for s in systems:
        doc["systems"][s.name]["extra"] = s.extra
    write_json_atomic(args.out / "compare.json", doc)
    print((args.out / "compare.md").read_text())
    write_intervals(args.out, args.slo.split(","))
    print(json.dumps(doc["runs"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
