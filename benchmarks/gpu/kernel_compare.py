"""Device time per kernel category per step: our engine vs vLLM on the same offline workload.

What it is for: our offline throughput is below vLLM's on the same H100 while our GPU is busy nearly all
the time, so the loss is device time per step. This script profiles a window of steady-state steps of both
systems on the same prompts and prints where each one's kernel time goes, category by category.

How it runs (one device call, after `run_serve_h100.sh stage` has brought flashinfer, vLLM and the traces):

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.gpu.kernel_compare --trace-path /tmp/azure

    python -m benchmarks.gpu.kernel_compare --systems ours --device cpu --model dummy:tiny-llama \\
        --num-prompts 16 --max-total-tokens 256 --warmup-steps 5 --profile-steps 3     # CPU smoke: no kernels

`--systems ours,ours+paged,vllm` also runs a variant of ours (`OUR_VARIANTS`: its engine built under an environment
switch, e.g. BULLET_RAY_PREFILL_ATTENTION=paged, or BULLET_RAY_DUMMY_INIT=uniform for `ours+vllminit`: dummy weights
drawn as vLLM draws them) on the same workload in the same call, its files beside the
default's (`ours_paged_prof/`, `ours_paged_steps.jsonl`), and prints the tables once per our system against vLLM.

Both systems get benchmarks/offline.py's workload (Azure-conversation lengths, token-id prompts drawn with a
fixed seed, greedy, ignore_eos, max_tokens from the trace), dummy weights, prefix caching off and the same
`--max-num-seqs` / `--max-num-batched-tokens` (vLLM's own offline defaults on an H100 are 1024 / 16384, not
ours, so they are passed explicitly). All requests are queued at once; steps `--warmup-steps` to
`--warmup-steps + --profile-steps - 1` (counted from each system's first step) run under torch.profiler.
The defaults (1,000 prompts, steps 400-429) sit in the run's steady state: ~255 sequences running with
prompt chunks joining from step ~100 to ~650; with 300 prompts the batch drains after step ~100 (at step 400
about 90 decode rows and no prompt tokens), so a 300-prompt run wants `--warmup-steps 50`.

- ours: benchmarks.offline's engine set-up with `profile_dir` (bullet_ray/engine/worker/step_profile.py
  writes `hybrid-trace.json.gz`); the step log gives each profiled step's tokens (rows in step order);
- vLLM: a child process (its packages first on the path from $VLLM_SITE) with the engine core in-process
  (VLLM_ENABLE_V1_MULTIPROCESSING=0), so `llm_engine.step()` drives the scheduler from here: the scheduled
  batches are counted, `llm.start_profile()` / `llm.stop_profile()` (ProfilerConfig: torch, no stacks) bracket
  the window, with a device synchronize on both sides. vLLM's worker names each step in its trace
  (`execute_context_N(T)_generation_M(G)`): those names give its step count and tokens.

Each trace's device events (`cat` kernel, and memcpy/memset as copy) are summed per category (`categorize`),
per step and per 1k tokens, with the top kernels; JSON in `--out/kernel_compare.json`, a markdown table last.

Then step by step (`step_costs`): every device event goes to the step whose host range (vLLM's step name; our
worker's `bullet_step_<n>`, step_profile.py) began last before the call that launched it (a kernel and its
launch share a correlation id), and over the window's steps at the median decode rows a least-squares line
splits a step's device time into a decode part (intercept) and ms per 1k prompt tokens (slope), for all kernels
and per group (GEMM, attention, ...): a second table. That is the per-prompt-token cost of a mixed step measured,
for both engines, from the same window.

What compares and what does not:
- the window is the same step numbers of the same workload, and both schedulers are chunked-prefill FCFS
  with the same limits, but not identical: a step of one may carry more prompt tokens than the other's.
  The tokens per step (decode rows, prompt tokens) are printed for both; `ms per 1k tokens` (total device
  ms / tokens processed in the window) is the fairer whole-step figure;
- attention does not split the same way: our flashinfer runs decode rows and prompt chunks through two
  kernels (attention_decode, attention_prefill); vLLM's FlashAttention-3 runs every row of a mixed batch
  through one varlen kernel (attention_prefill by name). Compare the `attention (all)` row;
- vLLM fuses norms, activations and rotary into torch.compile Triton kernels (`triton_*`); they are
  classed by the ops in their names (norm, activation, rotary ...), the rest stay `triton`;
- category sums are kernel time (overlapping kernels on two streams count twice); `device busy` is the
  union of the kernel intervals. The profilers slow the host, so gaps between kernels are not representative;
  the kernels' own durations are.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import re
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.offline import ENGINE_VARIANTS

logger = logging.getLogger(__name__)

CATEGORIES = ("gemm", "attention_prefill", "attention_decode", "kv_write", "norm", "activation", "rotary",
              "sampling", "copy", "triton", "other")
ATTENTION = ("attention_prefill", "attention_decode")
RESULT_PREFIX = "KC_VLLM_RESULT "

# Rules of `categorize`, first match wins (case-insensitive regexes on the kernel name):
_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((cat, re.compile(pattern, re.IGNORECASE)) for cat, pattern in (
    # split-KV decode kernels and the merges of their partial states (flashinfer, FlashAttention 2/3, vLLM's
    # own paged attention); before the prefill rules: `flash_fwd_splitkv` also starts with `flash_fwd`
    ("attention_decode", r"BatchDecodeWithPagedKVCache|SingleDecodeWithKVCache|MergeStates|merge_state"
                         r"|merge_attn_states|flash_fwd_splitkv|FlashAttnFwdCombine|flash_fwd_combine"
                         r"|paged_attention_v[12]"),
    # prompt/mixed-row attention: flashinfer's prefill kernels (FA2 BatchPrefill*, the SM90
    # PrefillWithKVCacheKernel, the persistent POD/batch-attention kernels), FlashAttention (FA3's
    # `flash::FlashAttnFwdSm90`, its `flash::prepare_varlen_num_blocks` scheduler, FA2 `flash_fwd_kernel`)
    ("attention_prefill", r"BatchPrefillWith|PrefillWithKVCache|PrefillWithRaggedKVCache|PersistentKernel"
                          r"|BatchAttention|flash::|FlashAttnFwd|flash_fwd|fmha|unified_attention"),
    # K/V into the paged cache: vLLM's reshape_and_cache(_flash), flashinfer's append, our index_put_ (a
    # scatter launched once per step, not per layer, lands here too: kernels per step tell them apart)
    ("kv_write", r"reshape_and_cache|concat_and_cache|AppendPagedKVCache|append_paged_kv|index_put"
                 r"|scatter"),
    ("norm", r"rms_?norm|layer_?norm|fused_add_rms"),
    ("activation", r"act_and_mul|silu|gelu|swiglu|vllm::activation_kernel"),
    ("rotary", r"rotary|(?<![a-z])rope"),
    # cuBLAS(Lt) (`nvjet_*`, `sm90_xmma_gemm_*`, gemv, split-K reduce), CUTLASS, Triton matmuls
    ("gemm", r"gemm|gemv|nvjet|matmul|cublas|cutlass|splitKreduce"),
    ("sampling", r"softmax|top_?k|topp|sort|argmax|argmin|gumbel|multinomial|sampling|exponential"),
    # data movement: copies, fills, concatenation, gathers (index_select, the embedding lookup)
    ("copy", r"^mem(cpy|set)|copy|fill|CatArray|(?<![a-z])cat(?![a-z])|gather|index_?select|indexSelect"),
))

# torch.compile's fused Triton kernels are named `triton_<red|poi|per|tem>_fused_<op>_<op>..._<n>`; the ops
# tell what they compute (first match wins; a fused add + RMSNorm shows add, mean, pow, rsqrt)
_TRITON_RULES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((cat, re.compile(pattern)) for cat, pattern in (
    ("norm", r"rsqrt|rms|mean.*pow|pow.*mean|layer_norm|native_layer_norm"),
    ("activation", r"silu|gelu|sigmoid"),
    ("rotary", r"rotary|rope|cos.*sin|sin.*cos|index_select.*cat|cat.*index_select"),
    ("sampling", r"argmax|softmax|topk|sort|gumbel|exponential"),
    ("gemm", r"(^|_)(mm|addmm|bmm)(_|$)|matmul"),
    ("kv_write", r"reshape_and_cache|index_put|scatter"),
))


def categorize(kernel_name: str) -> str:
    """The category of a CUDA kernel name (see `CATEGORIES`; the rules above, first match wins)."""
    name = kernel_name.strip()
    if name.startswith("triton_"):
        ops = name.lower()
        for cat, pattern in _TRITON_RULES:
            if pattern.search(ops):
                return cat
        return "triton"
    for cat, pattern in _RULES:
        if pattern.search(name):
            return cat
    return "other"


# ---------------------------------------------------------------- traces

def load_trace(path: str | Path) -> dict[str, Any]:
    """A torch.profiler chrome trace (`.json` or `.json.gz`)."""
    p = Path(path)
    opener: Any = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {"traceEvents": data}


DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_STEP_NAME = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
_OUR_STEP_NAME = re.compile(r"bullet_step_(\d+)")


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The trace's device events: kernels, and memcpy/memset (counted as copy)."""
    return [e for e in trace.get("traceEvents", []) if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]


def step_annotations(trace: dict[str, Any]) -> list[dict[str, int]]:
    """vLLM's per-step names (`execute_context_N(T)_generation_M(G)`, host side), in time order."""
    return [s for _, s in _vllm_step_ranges(trace)]


def _vllm_step_ranges(trace: dict[str, Any]) -> list[tuple[float, dict[str, int]]]:
    steps = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") != "user_annotation":
            continue
        m = _STEP_NAME.fullmatch(str(e.get("name", "")))
        if m:
            steps.append((float(e.get("ts", 0.0)), {
                "prefill_seqs": int(m.group(1)), "prefill_tokens": int(m.group(2)),
                "decode_seqs": int(m.group(3)), "decode_tokens": int(m.group(4))}))
    return sorted(steps, key=lambda x: x[0])


def our_step_starts(trace: dict[str, Any]) -> dict[int, float]:
    """Our worker's `bullet_step_<n>` ranges (step_profile.py): step number -> host start time (us). Only the
    host-side ranges: the profiler draws each range a second time on the GPU's timeline (`gpu_user_annotation`,
    device time), which would put launches into the wrong steps."""
    starts = {}
    for e in trace.get("traceEvents", []):
        m = _OUR_STEP_NAME.fullmatch(str(e.get("name", "")))
        if m and e.get("ph") == "X" and e.get("cat") == "user_annotation":
            starts[int(m.group(1))] = float(e.get("ts", 0.0))
    return starts


def per_step_device_ms(trace: dict[str, Any], starts: list[float]) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Device time per category of each step, the steps given by their host ranges' start times (ascending).

    A device event belongs to the step whose range began last before the host call that launched it (kernel
    and launch share a correlation id; a CUDA graph's kernels carry its cudaGraphLaunch's): launch-ahead and
    a sampling call outside the named range still land in the right step. Returns the per-step sums (ms, plus
    `all`, and `busy`: the union of the step's device intervals, what kernels running at once take together)
    and what could not be placed: `unmatched_ms` (no launch found), `before_ms` (launched before the first step)."""
    from bisect import bisect_right

    launched = {}
    for e in trace.get("traceEvents", []):
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launched[corr] = float(e.get("ts", 0.0))
    per_step: list[dict[str, float]] = [defaultdict(float) for _ in starts]
    intervals: list[list[tuple[float, float]]] = [[] for _ in starts]
    left = {"unmatched_ms": 0.0, "before_ms": 0.0}
    for e in device_events(trace):
        dur_ms = float(e.get("dur", 0.0)) / 1e3
        ts = launched.get((e.get("args") or {}).get("correlation"))
        if ts is None:
            left["unmatched_ms"] += dur_ms
            continue
        i = bisect_right(starts, ts) - 1
        if i < 0:
            left["before_ms"] += dur_ms
            continue
        cat = categorize(str(e.get("name", ""))) if e.get("cat") == "kernel" else "copy"
        per_step[i][cat] += dur_ms
        per_step[i]["all"] += dur_ms
        ts_us = float(e.get("ts", 0.0))
        intervals[i].append((ts_us, ts_us + float(e.get("dur", 0.0))))
    for d, spans in zip(per_step, intervals, strict=True):
        if spans:  # kernels of one step that ran at once (two streams) count once here
            d["busy"] = _busy_us(spans) / 1e3
    return [dict(d) for d in per_step], {k: round(v, 3) for k, v in left.items()}


# what the fit reports: every kernel, then the groups a prompt token's cost splits into
FIT_GROUPS: dict[str, tuple[str, ...]] = {
    "all": ("all",), "busy": ("busy",), "gemm": ("gemm",), "attention": ATTENTION, "kv_write": ("kv_write",),
    "norm_act_rotary_triton": ("norm", "activation", "rotary", "triton"), "rest": ("sampling", "copy", "other")}


def group_ms(step_ms: dict[str, float], group: str) -> float:
    """One step's device time in a FIT_GROUPS group (the sum of its categories; a category it lacks counts 0)."""
    return sum(step_ms.get(c, 0.0) for c in FIT_GROUPS[group])


def prompt_token_cost(steps: list[dict[str, int]], device_ms: list[dict[str, float]],
                      rows_tolerance: float = 0.1) -> dict[str, Any]:
    """Split a step's device time into a decode part and a per-prompt-token part.

    Over the window's steps whose decode rows are within `rows_tolerance` of the window's median (the decode
    part then nearly constant), a least-squares line ms = intercept + slope x prompt tokens per group of
    categories (FIT_GROUPS): the slope is what 1k prompt tokens add to a step beside that many decode rows,
    the intercept the step without prompt tokens (compare `decode_only_ms`, the mean of the window's steps
    without any)."""
    rows = sorted(s["decode_tokens"] for s in steps)
    if not rows:
        return {"num_steps": 0}
    median = rows[len(rows) // 2]
    kept = [(s["prefill_tokens"], d) for s, d in zip(steps, device_ms, strict=True)
            if abs(s["decode_tokens"] - median) <= rows_tolerance * max(1, median)]
    out: dict[str, Any] = {"decode_rows_median": median, "num_steps": len(kept),
                           "num_steps_with_prompt_tokens": sum(1 for p, _ in kept if p > 0)}
    xs = [p / 1e3 for p, _ in kept]
    n = len(xs)
    mean_x = sum(xs) / n if n else 0.0
    sxx = sum((x - mean_x) ** 2 for x in xs)
    for group in FIT_GROUPS:
        ys = [group_ms(d, group) for _, d in kept]
        mean_y = sum(ys) / n if n else 0.0
        only_decode = [y for x, y in zip(xs, ys, strict=True) if x == 0]
        fit: dict[str, Any] = {"decode_only_ms": round(sum(only_decode) / len(only_decode), 3) if only_decode else None}
        if n >= 3 and sxx > 0:
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
            intercept = mean_y - slope * mean_x
            sst = sum((y - mean_y) ** 2 for y in ys)
            sse = sum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
            fit.update(ms_per_1k_prompt_tokens=round(slope, 3), intercept_ms=round(intercept, 3),
                       r2=round(1 - sse / sst, 4) if sst > 0 else None)
        out[group] = fit
    return out


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            busy, end = busy + (e - s), e
        elif e > end:
            busy, end = busy + (e - end), e
    return busy


def summarize_trace(trace: dict[str, Any] | str | Path, num_steps: int, num_tokens: int | None = None,
                    top: int = 15) -> dict[str, Any]:
    """Per-category device time of a trace's window of `num_steps` steps.

    Returns total kernel ms, device-busy ms (union of intervals), per category {ms, ms_per_step, share,
    kernels_per_step}, ms per 1k tokens when `num_tokens` is given, and the `top` kernels by time."""
    if not isinstance(trace, dict):
        trace = load_trace(trace)
    events = device_events(trace)
    n = max(1, num_steps)
    total_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    intervals = []
    for e in events:
        name, dur = str(e.get("name", "")), float(e.get("dur", 0.0))
        cat = categorize(name) if e.get("cat") == "kernel" else "copy"
        total_us[cat] += dur
        count[cat] += 1
        by_name[name][0] += dur
        by_name[name][1] += 1
        ts = float(e.get("ts", 0.0))
        intervals.append((ts, ts + dur))
    all_us = sum(total_us.values())
    span_us = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0.0
    categories = {}
    for cat in CATEGORIES:
        categories[cat] = {"ms": round(total_us[cat] / 1e3, 3), "ms_per_step": round(total_us[cat] / 1e3 / n, 4),
                           "share": round(total_us[cat] / all_us, 4) if all_us else 0.0,
                           "kernels_per_step": round(count[cat] / n, 2)}
    top_kernels = [{"name": name[:240], "category": categorize(name) if not name.startswith("Mem") else "copy",
                    "ms": round(us / 1e3, 3), "ms_per_step": round(us / 1e3 / n, 4), "calls_per_step": round(c / n, 2),
                    "share": round(us / all_us, 4) if all_us else 0.0}
                   for name, (us, c) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]]
    out: dict[str, Any] = {
        "num_steps": num_steps, "num_device_events": len(events), "kernels_per_step": round(len(events) / n, 1),
        "kernel_ms": round(all_us / 1e3, 3), "kernel_ms_per_step": round(all_us / 1e3 / n, 3),
        "device_busy_ms_per_step": round(_busy_us(intervals) / 1e3 / n, 3),
        "device_span_ms_per_step": round(span_us / 1e3 / n, 3), "categories": categories, "top_kernels": top_kernels}
    if num_tokens:
        out["num_tokens"] = num_tokens
        out["kernel_ms_per_1k_tokens"] = round(all_us / 1e3 / num_tokens * 1e3, 4)
        for cat in CATEGORIES:
            categories[cat]["ms_per_1k_tokens"] = round(total_us[cat] / 1e3 / num_tokens * 1e3, 4)
    return out


def step_token_summary(steps: list[dict[str, int]]) -> dict[str, Any]:
    """Means of a window's steps: tokens, prompt tokens, decode rows (each step a dict of those counts)."""
    if not steps:
        return {"num_steps": 0}
    n = len(steps)
    prefill = sum(s["prefill_tokens"] for s in steps)
    decode = sum(s["decode_tokens"] for s in steps)
    return {"num_steps": n, "tokens": prefill + decode, "tokens_per_step": round((prefill + decode) / n, 1),
            "prompt_tokens_per_step": round(prefill / n, 1), "decode_rows_per_step": round(decode / n, 1),
            "prompt_seqs_per_step": round(sum(s["prefill_seqs"] for s in steps) / n, 2),
            "steps_with_prompt_tokens": sum(1 for s in steps if s["prefill_tokens"] > 0)}


def step_costs(trace: dict[str, Any], starts: list[float], steps: list[dict[str, int]]) -> dict[str, Any]:
    """`per_step_device_ms` of the window's steps with their tokens, and `prompt_token_cost` of them."""
    device_ms, left = per_step_device_ms(trace, starts)
    per_step = [{"prompt_tokens": s["prefill_tokens"], "decode_rows": s["decode_tokens"],
                 **{k: round(v, 3) for k, v in sorted(d.items())}} for s, d in zip(steps, device_ms, strict=True)]
    return {"fit": prompt_token_cost(steps, device_ms), "not_placed": left, "per_step": per_step}


# ---------------------------------------------------------------- ours

def _offline_args(args: argparse.Namespace, **overrides: Any) -> argparse.Namespace:
    """benchmarks.offline's arguments (its defaults) with this run's workload and limits."""
    from benchmarks import offline

    ns = offline.parse_args(["--model", args.model, "--device", args.device])
    ns.num_prompts, ns.seed, ns.trace_path = args.num_prompts, args.seed, args.trace_path
    ns.max_total_tokens, ns.max_num_seqs = args.max_total_tokens, args.max_num_seqs
    ns.max_num_batched_tokens, ns.schedule, ns.warmup = args.max_num_batched_tokens, "chunked", 0
    ns.piecewise_buckets = args.piecewise_buckets
    if args.kv_cache_gb is not None:
        ns.kv_cache_gb = args.kv_cache_gb
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns


def read_step_log(path: str | Path, first: int, num: int) -> list[dict[str, int]]:
    """Rows `first` .. `first + num - 1` of our step log (one row per launched step, in order), as counts."""
    rows = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "step":
                rows.append(rec)
    window = rows[first:first + num]
    out = []
    for r in window:
        decode = int(r.get("num_seqs", 0)) - int(r.get("num_prefill_seqs", 0))
        out.append({"prefill_seqs": int(r.get("num_prefill_seqs", 0)),
                    "prefill_tokens": int(r.get("num_tokens", 0)) - decode,
                    "decode_seqs": decode, "decode_tokens": decode})
    return out


def _num_step_rows(path: Path) -> int:
    try:
        with open(path) as f:
            return sum(1 for line in f if line.startswith('{"kind": "step"'))
    except OSError:
        return 0


# our engine's variants beside its default in one call (`--systems ours,ours+paged,vllm`): the environment each
# one's engine is built under (the attention backend reads these switches when a worker builds it)
OUR_VARIANTS: dict[str, dict[str, str]] = {name: ENGINE_VARIANTS[name] for name in ("ragged", "paged", "scatter",
                                                                                    "vllminit")}


def parse_systems(text: str) -> list[str]:
    """--systems: ours, vllm and ours+<variant> (OUR_VARIANTS), comma-separated; ValueError naming the unknown."""
    systems = [s.strip() for s in text.split(",") if s.strip()]
    known = {"ours", "vllm", *(f"ours+{v}" for v in OUR_VARIANTS)}
    unknown = sorted(set(systems) - known)
    if unknown:
        raise ValueError(f"--systems: unknown {unknown} (known: {', '.join(sorted(known))})")
    return systems


def run_ours(args: argparse.Namespace, system: str = "ours") -> dict[str, Any]:
    """Our engine (benchmarks.offline's set-up, chunked schedule) on every prompt at once; the hybrid worker
    profiles the window; the engine stops once the window is written (the rest of the run is not needed).
    `system` "ours+<variant>" builds the engine under OUR_VARIANTS[variant]'s environment; its files are
    `ours_<variant>_prof/` and `ours_<variant>_steps.jsonl` beside the default's."""
    from benchmarks.offline import environment

    variant = system.partition("+")[2]
    with environment(OUR_VARIANTS[variant] if variant else {}):
        result = _run_ours(args, f"ours_{variant}" if variant else "ours")
    if variant:
        result["system"] += f" ({' '.join(f'{k}={v}' for k, v in OUR_VARIANTS[variant].items())})"
    return result


def _run_ours(args: argparse.Namespace, stem: str) -> dict[str, Any]:
    from benchmarks import offline
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    prof = args.out / f"{stem}_prof"
    step_log = args.out / f"{stem}_steps.jsonl"
    prof.mkdir(parents=True, exist_ok=True)
    step_log.unlink(missing_ok=True)  # the step log appends
    for old in prof.glob("hybrid-*"):
        old.unlink()
    ns = _offline_args(args, profile_dir=str(prof), profile_start_step=args.warmup_steps,
                       profile_num_steps=args.profile_steps, step_log=str(step_log))
    config = offline.engine_config(ns)
    summary_path, trace = prof / "hybrid-summary.json", prof / "hybrid-trace.json.gz"
    result: dict[str, Any] = {"system": "bullet_ray chunked", "engine_switches": offline.engine_switches(),
                              "config": {k: getattr(config, k) for k in (
                                  "schedule", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_gb",
                                  "is_async_scheduling", "enforce_eager", "piecewise_buckets")}}
    started = time.perf_counter()
    with LLMEngine(config) as engine:
        result["startup_s"] = round(time.perf_counter() - started, 1)
        specs = offline.workload(ns, engine.vocab_size)
        params = [SamplingParams(temperature=0.0, max_tokens=s.output_tokens, ignore_eos=True) for s in specs]
        failure: list[BaseException] = []

        def generate() -> None:
            try:
                engine.generate([s.prompt for s in specs], params)
            except BaseException as exc:  # noqa: BLE001 - the shutdown below ends it with an error on purpose
                failure.append(exc)

        thread = threading.Thread(target=generate, name="kernel-compare-generate", daemon=True)
        started = time.perf_counter()
        thread.start()
        deadline = started + args.ours_timeout_s
        while not summary_path.is_file() and thread.is_alive() and time.perf_counter() < deadline:
            time.sleep(0.2)
        result["run_s"] = round(time.perf_counter() - started, 1)
        if not summary_path.is_file() and time.perf_counter() >= deadline:
            result["error"] = f"no profile window after {args.ours_timeout_s} s"
        # a step's row is logged once it is collected: the window's last one may still be on its way
        wanted, until = args.warmup_steps + args.profile_steps, time.perf_counter() + 10
        while thread.is_alive() and _num_step_rows(step_log) < wanted and time.perf_counter() < until:
            time.sleep(0.1)
        # leaving the block shuts the engine down: requests still running end with an error output
    thread.join(30)
    if not trace.is_file():
        result.setdefault("error", f"no profile trace {trace}: the run had fewer than "
                                   f"{args.warmup_steps + args.profile_steps} steps; lower --warmup-steps or raise "
                                   f"--num-prompts" + (f" ({failure[0]!r})" if failure else ""))
        return result
    steps = read_step_log(step_log, args.warmup_steps, args.profile_steps) if step_log.is_file() else []
    tokens = step_token_summary(steps)
    if len(steps) < args.profile_steps:
        result["warning"] = f"step log has {len(steps)} rows in the window of {args.profile_steps} steps"
    result["steps"] = tokens
    result["trace"] = str(trace)
    result["profile_summary"] = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    # a run that ended inside the window wrote it as far as it got: the step log says how far
    num_steps = len(steps) if 0 < len(steps) < args.profile_steps else args.profile_steps
    trace_data = load_trace(trace)
    result.update(summarize_trace(trace_data, num_steps, tokens.get("tokens"), top=args.top))
    starts = our_step_starts(trace_data)
    numbers = range(args.warmup_steps, args.warmup_steps + len(steps))
    if steps and all(n in starts for n in numbers):
        result["step_costs"] = step_costs(trace_data, [starts[n] for n in numbers], steps)
    else:
        result["step_costs"] = {"error": f"trace names {len(starts)} bullet_step ranges, the step log {len(steps)}"}
    return result


# ---------------------------------------------------------------- vLLM (child process)

def run_vllm_child(args: argparse.Namespace) -> dict[str, Any]:
    """In the child: vLLM's engine stepped from here, torch.profiler over the same window of steps."""

    import torch
    import vllm  # type: ignore[import-not-found]
    from vllm import LLM, SamplingParams, TokensPrompt  # type: ignore[import-not-found]

    from benchmarks import offline

    folder, specs = offline.vllm_model_and_workload(_offline_args(args))
    prof = (args.out / "vllm_prof").resolve()
    prof.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", enable_prefix_caching=False,
              max_model_len=args.max_total_tokens, seed=args.seed, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              profiler_config={"profiler": "torch", "torch_profiler_dir": str(prof),
                               "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
                               "ignore_frontend": True})
    startup_s = time.perf_counter() - started
    engine = llm.llm_engine
    scheduled: list[tuple[int, int]] = []  # (tokens, requests) of each batch with tokens
    try:
        scheduler = engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule

        def counting_schedule(*a: Any, **k: Any) -> Any:
            out = schedule(*a, **k)
            if out.total_num_scheduled_tokens > 0:
                scheduled.append((int(out.total_num_scheduled_tokens), len(out.num_scheduled_tokens)))
            return out

        scheduler.schedule = counting_schedule
        counter = "scheduler"
    except AttributeError:  # the engine core runs elsewhere: count step() calls instead
        counter = "step_calls"
    for i, s in enumerate(specs):
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=list(s.prompt)),  # type: ignore[arg-type]
                           SamplingParams(temperature=0.0, max_tokens=s.output_tokens, ignore_eos=True))
    calls = 0

    def step_until(num: int) -> None:
        nonlocal calls
        limit = calls + 20 * max(1, num - (len(scheduled) if counter == "scheduler" else calls)) + 100
        while (len(scheduled) if counter == "scheduler" else calls) < num:
            if not engine.has_unfinished_requests() or calls > limit:
                raise RuntimeError(f"vLLM stopped at {len(scheduled)} scheduled steps ({calls} step calls), "
                                   f"before step {num}: lower --warmup-steps or raise --num-prompts")
            engine.step()
            calls += 1

    t0 = time.perf_counter()
    step_until(args.warmup_steps)
    warm_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    first = len(scheduled)
    llm.start_profile()
    t0 = time.perf_counter()
    step_until(args.warmup_steps + args.profile_steps)
    torch.cuda.synchronize()
    window_s = time.perf_counter() - t0
    last = len(scheduled)
    llm.stop_profile()
    traces = sorted(prof.rglob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    result: dict[str, Any] = {"system": f"vllm {vllm.__version__}", "startup_s": round(startup_s, 1),
                              "warmup_s": round(warm_s, 1), "window_s": round(window_s, 2), "step_counter": counter,
                              "scheduled_in_window": [t for t, _ in scheduled[first:last]],
                              "config": {"max_num_seqs": args.max_num_seqs,
                                         "max_num_batched_tokens": args.max_num_batched_tokens,
                                         "enable_prefix_caching": False, "in_process_engine_core": counter == "scheduler",
                                         "async_scheduling": _vllm_async(engine)}}
    if not traces:
        result["error"] = f"vLLM wrote no *.pt.trace.json* under {prof}"
        return result
    trace_path = traces[-1]
    trace = load_trace(trace_path)
    steps = step_annotations(trace)
    num_steps = len(steps) or (last - first)
    tokens = step_token_summary(steps) if steps else {
        "num_steps": last - first, "tokens": sum(t for t, _ in scheduled[first:last]),
        "tokens_per_step": round(sum(t for t, _ in scheduled[first:last]) / max(1, last - first), 1)}
    if steps and counter == "scheduler" and len(steps) != last - first:
        result["warning"] = f"trace names {len(steps)} steps, the scheduler counted {last - first}"
    result.update(trace=str(trace_path), steps=tokens)
    result.update(summarize_trace(trace, num_steps, tokens.get("tokens"), top=args.top))
    ranges = _vllm_step_ranges(trace)
    if ranges:
        result["step_costs"] = step_costs(trace, [ts for ts, _ in ranges], [st for _, st in ranges])
    return result


def _vllm_async(engine: Any) -> Any:
    try:
        return bool(engine.vllm_config.scheduler_config.async_scheduling)
    except AttributeError:
        return None


def run_vllm(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """vLLM in a child process (its own packages first on the path), killed with its group on timeout."""
    from benchmarks.offline import run_child, vllm_child_env

    cmd = [sys.executable, "-m", "benchmarks.gpu.kernel_compare", *argv, "--vllm-child"]
    env = vllm_child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return run_child(cmd, env, args.out / "vllm_child.log", args.vllm_timeout_s, RESULT_PREFIX)


# ---------------------------------------------------------------- report

def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """Rows = categories, columns = ours and vLLM ms/step, their ratio, shares and kernels per step."""
    ours, vllm = results.get("ours") or {}, results.get("vllm") or {}

    def cat(sysres: dict[str, Any], name: str, key: str) -> float | None:
        cats = sysres.get("categories")
        if not cats:
            return None
        if name == "attention (all)":
            return sum(cats[c][key] for c in ATTENTION)
        return cats[name][key]

    lines = ["| category | ours ms/step | vLLM ms/step | ours/vLLM | ours share | vLLM share "
             "| ours kernels/step | vLLM kernels/step |", "|---|---|---|---|---|---|---|---|"]
    for name in (*CATEGORIES, "attention (all)"):
        o, v = cat(ours, name, "ms_per_step"), cat(vllm, name, "ms_per_step")
        if not o and not v and name != "attention (all)":
            continue
        ratio = o / v if o is not None and v else None
        lines.append(f"| {name} | {_fmt(o)} | {_fmt(v)} | {_fmt(ratio)} | {_fmt(cat(ours, name, 'share'), 3)} "
                     f"| {_fmt(cat(vllm, name, 'share'), 3)} | {_fmt(cat(ours, name, 'kernels_per_step'), 1)} "
                     f"| {_fmt(cat(vllm, name, 'kernels_per_step'), 1)} |")

    def row(label: str, key: str, digits: int = 2, sub: str | None = None) -> str:
        o = (ours.get(sub) or {}).get(key) if sub else ours.get(key)
        v = (vllm.get(sub) or {}).get(key) if sub else vllm.get(key)
        ratio = o / v if isinstance(o, (int, float)) and isinstance(v, (int, float)) and v else None
        return f"| {label} | {_fmt(o, digits)} | {_fmt(v, digits)} | {_fmt(ratio)} | | | | |"

    lines += [row("**all kernels**", "kernel_ms_per_step"), row("device busy (union)", "device_busy_ms_per_step"),
              row("kernels per step", "kernels_per_step", 1), row("tokens per step", "tokens_per_step", 1, "steps"),
              row("prompt tokens per step", "prompt_tokens_per_step", 1, "steps"),
              row("decode rows per step", "decode_rows_per_step", 1, "steps"),
              row("**kernel ms per 1k tokens**", "kernel_ms_per_1k_tokens", 3)]
    return "\n".join(lines)


def prompt_cost_table(results: dict[str, dict[str, Any]]) -> str:
    """What a step's device time is made of, ours beside vLLM: the decode part (intercept) and ms per 1k prompt
    tokens (slope) of `prompt_token_cost`, per group of categories."""
    fits = {name: ((results.get(name) or {}).get("step_costs") or {}).get("fit") or {} for name in ("ours", "vllm")}
    ours, vllm = fits["ours"], fits["vllm"]
    lines = ["| group | ours ms / 1k prompt tokens | vLLM ms / 1k prompt tokens | ours/vLLM | ours decode part ms "
             "| vLLM decode part ms | ours r2 | vLLM r2 |", "|---|---|---|---|---|---|---|---|"]
    for group in FIT_GROUPS:
        o, v = ours.get(group) or {}, vllm.get(group) or {}
        os_, vs = o.get("ms_per_1k_prompt_tokens"), v.get("ms_per_1k_prompt_tokens")
        lines.append(f"| {group} | {_fmt(os_)} | {_fmt(vs)} | {_fmt(os_ / vs if os_ is not None and vs else None)} "
                     f"| {_fmt(o.get('intercept_ms'))} | {_fmt(v.get('intercept_ms'))} | {_fmt(o.get('r2'), 3)} "
                     f"| {_fmt(v.get('r2'), 3)} |")
    lines.append(f"| steps fitted (with prompt tokens) | {ours.get('num_steps', '-')} "
                 f"({ours.get('num_steps_with_prompt_tokens', '-')}) | {vllm.get('num_steps', '-')} "
                 f"({vllm.get('num_steps_with_prompt_tokens', '-')}) | | {ours.get('decode_rows_median', '-')} rows "
                 f"| {vllm.get('decode_rows_median', '-')} rows | | |")
    return "\n".join(lines)


def matched_steps_table(results: dict[str, dict[str, Any]], min_steps: int = 2) -> str:
    """Steps of both windows with the same prompt tokens (and decode rows within 10%), side by side: mean device
    ms per group of categories. The fit's slopes compare engines over different mixes of chunks; steps of the
    same size compare like with like (e.g. a full 1,985-token chunk beside ~63 decode rows)."""
    rows = {name: ((results.get(name) or {}).get("step_costs") or {}).get("per_step") or [] for name in ("ours", "vllm")}
    by_size: dict[int, dict[str, list[dict[str, float]]]] = defaultdict(lambda: {"ours": [], "vllm": []})
    for name, steps in rows.items():
        for st in steps:
            by_size[st["prompt_tokens"]][name].append(st)
    lines = ["| prompt tokens | steps ours / vLLM | decode rows | group | ours ms | vLLM ms | ours - vLLM |",
             "|---|---|---|---|---|---|---|"]
    for size in sorted(by_size):
        ours, vllm = by_size[size]["ours"], by_size[size]["vllm"]
        if len(ours) < min_steps or len(vllm) < min_steps:
            continue
        rows_o = sum(st["decode_rows"] for st in ours) / len(ours)
        rows_v = sum(st["decode_rows"] for st in vllm) / len(vllm)
        if abs(rows_o - rows_v) > 0.1 * max(rows_o, rows_v, 1):
            continue
        for group in ("all", "gemm", "attention", "kv_write", "norm_act_rotary_triton"):
            o = sum(group_ms(st, group) for st in ours) / len(ours)
            v = sum(group_ms(st, group) for st in vllm) / len(vllm)
            lines.append(f"| {size} | {len(ours)} / {len(vllm)} | {rows_o:.1f} / {rows_v:.1f} | {group} | {o:.2f} "
                         f"| {v:.2f} | {o - v:+.2f} |")
    return "\n".join(lines)


def print_report(results: dict[str, dict[str, Any]], title: str) -> None:
    print(f"\n{title}:\n")
    print(markdown_table(results), flush=True)
    print("\nEach step's device time split into a decode part and a per-prompt-token part (steps at the window's "
          "median decode rows, least squares; `step_costs` in the JSON):\n")
    print(prompt_cost_table(results))
    print("\nSteps of the same size in both windows (mean device ms; prompt tokens 0: decode-only steps):\n")
    print(matched_steps_table(results), flush=True)


def top_kernels_text(label: str, res: dict[str, Any], num: int = 15) -> str:
    rows = [f"{label}: top kernels (ms/step, calls/step, category)"]
    for k in res.get("top_kernels", [])[:num]:
        rows.append(f"  {k['ms_per_step']:8.3f} {k['calls_per_step']:7.1f}  {k['category']:<17} {k['name'][:110]}")
    return "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--systems", default="ours,vllm",
                        help="comma-separated: ours, vllm, and our variants " +
                             ", ".join(f"ours+{v} ({' '.join(f'{k}={x}' for k, x in env.items())})"
                                       for v, env in OUR_VARIANTS.items()))
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--device", default="cuda", help="ours only (vLLM runs on the GPU)")
    parser.add_argument("--num-prompts", type=int, default=1000,
                        help="1,000 (the throughput figure's run) keeps the batch full (~255 running, prompt chunks "
                             "joining) from step ~100 to ~650; with 300 the batch drains after step ~100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-path", default=None, help="Azure trace folder/CSV (default: benchmarks.traces')")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="prompt + output cap (max_model_len)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-gb", type=float, default=None, help="ours (default: benchmarks.offline's)")
    parser.add_argument("--piecewise-buckets", choices=("tuned", "fixed"), default="tuned",
                        help="ours: piecewise graphs' token buckets above 512 tokens (EngineConfig.piecewise_buckets)")
    parser.add_argument("--warmup-steps", type=int, default=400, help="steps before the profiled window")
    parser.add_argument("--profile-steps", type=int, default=30, help="profiled steps")
    parser.add_argument("--top", type=int, default=15, help="top kernels kept per system")
    parser.add_argument("--ours-timeout-s", type=int, default=240, help="our run's wait for its profile window")
    parser.add_argument("--vllm-timeout-s", type=int, default=420, help="the vLLM child is killed after this")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")), help="output folder")
    parser.add_argument("--report", type=Path, default=None,
                        help="print the tables of a saved kernel_compare.json and exit (no run)")
    parser.add_argument("--vllm-child", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.report is not None:  # the tables again from a saved run (no GPU)
        saved = json.loads(args.report.read_text())
        print_reports({k: v for k, v in saved.items() if (k == "vllm" or k.startswith("ours")) and isinstance(v, dict)},
                      f"Device time per step ({args.report}, {saved.get('date')})")
        return 0
    if args.trace_path is None:
        from benchmarks.traces import default_trace_dir

        args.trace_path = str(default_trace_dir())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.vllm_child:
        try:
            result = run_vllm_child(args)
        except BaseException as exc:  # noqa: BLE001 - the parent reports it
            logger.exception("vLLM child failed")
            result = {"error": f"vLLM run failed: {type(exc).__name__}: {exc}"}
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        os._exit(0)  # skip vLLM's teardown (threads, compile workers): the parent kills the group anyway
    try:
        systems = parse_systems(args.systems)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    payload: dict[str, Any] = {
        "benchmark": "kernel_compare", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "python -m benchmarks.gpu.kernel_compare " + " ".join(argv),
        "workload": {"dataset": "azure-conv", "num_prompts": args.num_prompts, "seed": args.seed,
                     "max_total_tokens": args.max_total_tokens, "max_num_seqs": args.max_num_seqs,
                     "max_num_batched_tokens": args.max_num_batched_tokens, "greedy": True, "ignore_eos": True,
                     "window": [args.warmup_steps, args.warmup_steps + args.profile_steps - 1]},
        "categories": list(CATEGORIES)}
    out_json = args.out / "kernel_compare.json"
    results: dict[str, dict[str, Any]] = {}

    def save() -> None:
        out_json.write_text(json.dumps({**payload, **results}, indent=1))

    for system in (s for s in systems if s.startswith("ours")):
        try:
            results[system] = run_ours(args, system)
        except Exception as exc:  # noqa: BLE001 - vLLM still runs; the JSON says what failed
            logger.exception("our run (%s) failed", system)
            results[system] = {"error": f"our run failed: {type(exc).__name__}: {exc}"}
        save()
    if "vllm" in systems:
        child_argv = [a for a in argv if a != "--vllm-child"]
        if "--out" not in child_argv:
            child_argv += ["--out", str(args.out)]
        try:
            results["vllm"] = run_vllm(args, child_argv)
        except Exception as exc:  # noqa: BLE001
            logger.exception("vLLM run failed")
            results["vllm"] = {"error": f"vLLM run failed: {type(exc).__name__}: {exc}"}
    from benchmarks.offline import device_info

    payload["device"] = device_info()
    save()
    for name, res in results.items():
        if res.get("top_kernels"):
            print(top_kernels_text(name, res, args.top))
        for key in ("error", "warning"):
            if res.get(key):
                print(f"{name} {key}: {res[key]}")
        print(f"{name}: {res.get('system')} steps {json.dumps(res.get('steps'))}")
    print(f"saved {out_json}")
    window = f"steps {args.warmup_steps}-{args.warmup_steps + args.profile_steps - 1} ({payload['device'].get('name')})"
    print_reports(results, f"Device time per step, {window}")
    return 0


def print_reports(results: dict[str, dict[str, Any]], title: str) -> None:
    """The tables of each of our systems against vLLM (in the tables' "ours" columns), one report per system."""
    ours = [name for name in results if name.startswith("ours")] or ["ours"]
    for name in ours:
        label = "" if name == "ours" else f"; ours = {name}"
        print_report({"ours": results.get(name) or {}, "vllm": results.get("vllm") or {}}, title + label)


if __name__ == "__main__":
    sys.exit(main())
