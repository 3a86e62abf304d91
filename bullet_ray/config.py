"""Engine configuration: one frozen dataclass, every field documented with its bounds.

The YAML/HTTP edge (Serve builder args) validates with pydantic and converts to `EngineConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from bullet_ray.errors import ConfigError
from bullet_ray.perf.model import SATURATION_SHARE
from bullet_ray.policy.ordering import ORDERS

if TYPE_CHECKING:
    from bullet_ray.perf.model import PerfModel
    from bullet_ray.policy.bullet import BulletPolicy
    from bullet_ray.policy.slo import SloTargets

Schedule = Literal["bullet", "chunked", "static"]
SCHEDULES: tuple[str, ...] = ("bullet", "chunked", "static")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
SPLIT_SWITCHES: tuple[str, ...] = ("disjoint", "overlap")
HANDOFFS: tuple[str, ...] = ("front", "direct")
PREFILL_GEMMS: tuple[str, ...] = ("auto", "cublas", "cublaslt", "cublaslt-all")
# BULLET_RAY_PREFILL_ATTENTION's values (bullet_ray.engine.attention.flashinfer_backend.default_prefill_attention), here
# so that a benchmark's flag can check them without importing the GPU backend
PREFILL_ATTENTION_MODES: tuple[str, ...] = ("paged", "ragged")
TTFT_MARGIN_SCOPES: tuple[str, ...] = ("all", "order")
# how the split policy orders the prefill queue (EngineConfig.prefill_order): the orders least_slack_order knows
PREFILL_ORDERS: tuple[str, ...] = ORDERS
MAX_PREFILL_LAYER_GROUPS = 256  # more groups than layers run one layer per group


def ladder_problem(counts: object) -> str | None:
    """Why `counts` is not a split ladder (EngineConfig.decode_sm_counts: a non-empty list of whole decode SM counts
    >= 1, strictly ascending), or None: the one check behind the field, the YAML edge and the CLIs' ladder flags."""
    if isinstance(counts, (str, bytes)) or not isinstance(counts, (list, tuple)):
        return f"need a list of decode SM counts, or null for the default ladder; got {counts!r}"
    if not counts:
        return "the ladder is empty; give at least one decode SM count, or null"
    bad = [c for c in counts if isinstance(c, bool) or not isinstance(c, int) or c < 1]
    if bad:
        return f"every decode SM count must be a whole number >= 1, got {bad}"
    if any(b <= a for a, b in zip(counts, counts[1:])):
        return f"need strictly ascending decode SM counts, got {list(counts)}"
    return None


def parse_ladder(text: str) -> list[int]:
    """A split ladder from a command line ("8,16,24"): its decode SM counts, or ValueError saying why it is not one
    (the CLIs' ladder flags, `ladder_problem` behind them)."""
    try:
        counts = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"need comma-separated whole numbers, got {text!r}") from None
    problem = ladder_problem(counts)
    if problem is not None:
        raise ValueError(problem)
    return counts


def resolve_prefill_gemm(prefill_gemm: str, is_gpu: bool, dtype: str, schedule: str) -> str:
    """An `EngineConfig.prefill_gemm` with "auto" resolved: cublaslt for a prefill worker on green partitions (GPU,
    bfloat16: the bullet schedule, where it was measured to pay, and the static one, whose prefill side runs the same
    way), cublas elsewhere. `bullet-ray profile` resolves its --prefill-gemm with it too."""
    if prefill_gemm != "auto":
        return prefill_gemm
    fits = is_gpu and dtype == "bfloat16" and schedule in ("bullet", "static")
    return "cublaslt" if fits else "cublas"


@dataclass(frozen=True)
class EngineConfig:
    """How one engine (one GPU, or the CPU) serves one model."""

    # model: a Hugging Face folder, a .gguf file, "dummy:<preset|config.json>", or the embedded default
    model: str = "smollm2-135m-instruct"
    # "auto": float32 on CPU, bfloat16 on GPU
    dtype: str = "auto"
    # "cpu" or "cuda" (the workers' device; the engine front process never touches the GPU)
    device: str = "cpu"
    # "bullet": prefill and decode workers side by side (two processes); "chunked": one process, one
    # hybrid batch per step under max_num_batched_tokens (the vLLM/SGLang default, the baseline);
    # "static": like bullet with a fixed SM split
    schedule: str = "bullet"
    # "auto": torch on CPU, flashinfer on GPU
    attention_backend: str = "auto"
    # tokens per KV block (>= 1; 16 is a good default on both CPU and GPU)
    block_size: int = 16
    # number of KV blocks; None: as many as kv_cache_memory_gb allows
    num_kv_blocks: int | None = None
    # memory for the KV pool when num_kv_blocks is None (GiB, > 0)
    kv_cache_memory_gb: float = 0.25
    # longest prompt + output (tokens); None: the model's max_position_embeddings, capped by the pool
    max_model_len: int | None = None
    # most sequences in one decode batch (>= 1)
    max_num_seqs: int = 64
    # token budget of one prefill batch (bullet) or hybrid batch (chunked) (>= block_size)
    max_num_batched_tokens: int = 2048
    # free blocks the prefill side leaves for running sequences to grow into (fraction of the pool, 0..0.5)
    kv_watermark: float = 0.01
    # seed for dummy weights
    seed: int = 0
    # disable CUDA graphs (GPU only)
    enforce_eager: bool = False
    # largest step (tokens, >= 0; 0: off) that runs through piecewise CUDA graphs (every piece of the forward
    # between two attentions is one graph per token bucket, captured at start; attention runs eagerly
    # between them: bullet_ray.engine.piecewise_graphs). Steps with prompt tokens of the chunked schedule
    # and of the bullet prefill side; larger steps run eagerly (GPU only, off with enforce_eager). On the
    # H100 an eager step of Llama-3.1-8B was launch-bound below ~1,000 tokens and GPU-bound above
    # (benchmarks/results/serve_h100_m2e); a step through these graphs also launches ahead of the collect
    # of the step before (async_scheduling). None (default): the whole token budget on a worker that runs
    # on one partition (the chunked schedule's hybrid worker: offline at vLLM's 16,384-token budget every
    # step then launches ahead, 18.98 vs 17.42 req/s with 2,048 on the H100, benchmarks/results/lease_m2l),
    # and at most 2,048 on a prefill side (bullet, static), which captures the set once per ladder entry
    piecewise_graph_tokens: int | None = None
    # token buckets of the piecewise graphs above 512 tokens: "tuned" (default) chooses them at start from the
    # device's own GEMM times at every 32 tokens to 4,096, 64 to 8,192, 128 to 16,384 (at most as many buckets as
    # "fixed": bullet_ray.engine.piecewise_graphs' tune_buckets), "fixed" keeps token_buckets' (every 64 to 1,024,
    # 128 to 4,096, 256 to 8,192, 512 beyond)
    piecewise_buckets: str = "tuned"
    # plan and launch step k+1 while step k runs; sampled ids stay on the device as the next input and the
    # host learns them one step late (stop checks, streaming, freeing blocks). None: on for GPU, off for
    # CPU. Only steps through CUDA graphs (decode graphs, piecewise graphs) launch ahead of the collect: an
    # eager step's launch blocks once the device's queue is full, which is why launching every step ahead
    # cost goodput on the H100 (benchmarks/results/serve_h100_m2/sync-diagnostic); on CPU it only delays
    # every token by a step
    async_scheduling: bool | None = None
    # SM partition backend on GPU: "auto" (green contexts when available), "green", "mps", "none"
    partition: str = "auto"
    # decode SMs of the fixed split of the "static" schedule (None: half the GPU)
    static_decode_sms: int | None = None
    # the SM split ladder of the bullet and static schedules: decode SM counts, ascending, prefill taking the rest
    # (on a GPU each rounded up to its green-context granularity, 8 SMs on Hopper, and each side keeps >= 1 SM).
    # None (default): 16 to the GPU's SMs - 16 in steps of 8 (16, 24, ..., 112 on a 132-SM H100 / H200). Why a
    # deployment may set it: under the relaxed SLO decode sat on the ladder's floor (16 SMs) in 85-87% of its steps
    # while prefill ran on the 116 left (benchmarks/results/serve_h200_m9/); a floor of 8 gives prefill
    # 124. Every entry costs start-up time and memory: its decode graphs and prefill piecewise graphs are captured at
    # start (serve_h100 modifier -fl<sms>: the default ladder from that floor)
    decode_sm_counts: tuple[int, ...] | None = None
    # SM split of the "bullet" schedule: "fixed" (stays at the middle of the ladder), "slo" (the prefill
    # worker decides it at every step boundary from the performance model and the ttft/tpot targets,
    # bullet_ray.policy, docs/policy.md; the GPU deployments in deploy/ set it, with ttft_margin_ms 50: it led
    # chunked prefill and vLLM at strict in the H100 and H200 serving runs), "auto" (fixed: the engine's own
    # default, which a CPU deployment and the tests get)
    split_policy: str = "auto"
    # layer-wise prefill (the prefill worker of the bullet and static schedules): a prefill batch of >= prefill_layer_group_min_tokens new tokens
    # runs through the model in this many groups of layers (1..num layers; 1: whole forward, the default),
    # and the SM split may move between groups (bullet_ray.engine.layerwise, docs/policy.md)
    prefill_layer_groups: int = 1
    # smallest prefill batch (new tokens, >= 1) that runs layer-wise when prefill_layer_groups > 1
    prefill_layer_group_min_tokens: int = 2048
    # decode steps in pieces (the bullet schedule's decode worker with split_policy slo and split_switch overlap): a
    # decode step runs as this many CUDA graphs of consecutive layers (1..num layers; 1: one graph, the default),
    # launched just in time, each once the piece two before it has finished, so that the side moves to a requested
    # split at its next piece instead of its next step (bullet_ray.engine.cuda_graphs, docs/policy.md: issue 12's
    # decision-to-new-split goal). Costs a host wait per piece and `decode_pieces` x the decode graphs at start.
    # Served on an H200 (benchmarks/results/serve_h200_m20): 32 pieces took the switch's acked median from 9.5 to
    # 0.27 ms at no measurable goodput gain or cost on one draw, so it stays off by default
    decode_pieces: int = 1
    # the prefill worker (GPU) plans its next batch only this long (ms, >= 0) before the step in flight is
    # predicted to end, or once it has ended, reading arrivals meanwhile, so that a prompt arriving during a long
    # prefill step joins the next batch; None: plan (and launch) the next batch at once, as every worker does.
    # On the H100 (benchmarks/results/serve_h100_m2k) an arrival waited ~1.5 prefill steps before its own. The
    # default since the thirty-first session, on two A/Bs of one draw each: on an H200 (serve_h200_m6/seed4) 10 ms
    # took the prefill worker's read of a new prompt from 30 ms after the front sent it to 0.3 ms and strict
    # goodput 28.0 -> 30.4 req/s (bootstrap P 0.72; TTFT p50 at 32 req/s rose 130 -> 167 ms while p90 fell); on
    # the H100 (serve_h100_m2l) goodput stayed equal and TTFT p50 fell. Measured on the bullet schedule with the
    # slo policy only (the static schedule and the fixed split get it unmeasured). Not after a layer-wise step
    # (PrefillWorker.wait_to_plan). On CPU a launch computes the step: nothing in flight, nothing changes
    prefill_plan_lead_ms: float | None = 10.0
    # with the split policy, while the prefill worker idles and decode runs: it wakes this often (ms) to decide the
    # split again once decode has published a step (SplitDecider.is_due), so that decode leaves a prefill-heavy entry
    # within about a decode step of prefill running dry; None (default): it wakes on a message or after the idle
    # wait (0.5 s), so decode can sit on the entry of prefill's last decision that long (docs/policy.md, the
    # thirty-sixth section's finding). Opt-in: served at 5 ms beside the shipped deployment on an H200 (serve_h100's
    # -iw5, benchmarks/results/serve_h200_m12/idle_ab/) it stayed inside every bootstrap interval (strict 38.00 vs
    # 37.54, relaxed 46.86 vs 48.00 req/s), no change at 16 req/s where it acts
    prefill_idle_decide_ms: float | None = None
    # how a split switch moves the two sides (split_policy slo; bullet_ray.gpu.switch): "disjoint":
    # the side that shrinks finishes its step in flight before it acks and the side that grows waits for that
    # ack, so the two sides' SMs never overlap; a switch then waits for a whole step of the shrinking side
    # (the H100 serving runs: p50 43-81 ms, p99 220-630 ms). "overlap": each side moves at its next launch
    # without waiting for the other (its next step waits on its own last one, on the new SMs): the growing
    # side takes its new SMs at once and shares them with the other side's step in flight until that ends.
    # "overlap" is the default since the H100 A/B of the eighteenth session (benchmarks/results/serve_h100_m2v/): switch p50
    # 7.1 ms / p99 20 ms against disjoint's 24 / 411 ms, goodput alike
    split_switch: str = "overlap"
    # how a prefilled sequence reaches the decode worker (the bullet and static schedules): "front" (default):
    # in the prefill worker's step message to the engine front, which relays it; "direct": the prefill worker
    # sends it to the decode worker over a socket of their own and tells the front (bullet_ray.engine.worker.handoff).
    # Both record each hand-off's time from the prefill worker's send to the decode worker taking it
    handoff: str = "front"
    # the bullet schedule's fallback to chunked prefill under overload (split_policy slo): once this many
    # prompt tokens wait for prefill (>= 1) while decode runs, the prefill worker hands its queued prompts to
    # the decode worker, which takes them in chunks into its steps (decode rows first, the token budget
    # filled with prompt chunks: one read of the weights for both) on the whole GPU (an extra ladder entry
    # past the last: decode has every SM, the prefill side none and nothing to run; piecewise graphs for
    # it captured at start), until the prompts waiting on both sides fall under a quarter of it. None
    # (default): off: it has not paid on the H100. On the whole GPU its steps match chunked's (56 ms per
    # 2,048 tokens) but goodput fell (benchmarks/results/serve_h100_m2n, strict / relaxed: 16,384 -> 24.5 /
    # 33.3, 8,192 -> 19.5 / 33.1, off 25.2 / 34.3): TPOT stretches while it runs, and its first-come order
    # makes a whole burst wait; its first form (eager on 112 SMs, serve_h100_m2m) lost by more
    mixed_fallback_tokens: int | None = None
    # token budget of a decode step in the mixed fallback (its decode rows and prompt chunks; >= block_size):
    # the chunked schedule's, not the prefill side's larger budget, which would stretch every decode step
    mixed_chunk_tokens: int = 2048
    # latency targets of the split policy (ms, > 0); the defaults are DESIGN.md's strict preset
    ttft_target_ms: float = 500.0
    tpot_target_ms: float = 25.0
    # Bullet's per-prompt-token TTFT target (ms per prompt token, > 0; bullet_ray.bench.slo's bullet-* presets:
    # ShareGPT 3, Azure code and arXiv 1.5): a request's TTFT target becomes max(ttft_target_ms, this x its
    # prompt tokens), for the split policy and the engine's SLO metrics; ttft_target_ms stays the floor.
    # None (default): ttft_target_ms for every request
    ttft_target_ms_per_prompt_token: float | None = None
    # the split policy plans as if every request's TTFT target (the two fields above, and a target a controller
    # pushes) were this much shorter (ms, >= 0; < ttft_target_ms unless the targets are per prompt token; 0, the
    # default: off; never below a tenth of the target): the prefill queue's least-slack order and which requests
    # count as lost, the batches' fit, the split rule's TTFT risk and backlog (ttft_margin_scope says which of
    # these). It leaves the SLO metrics, admission (admission_ttft_s) and the predicted TTFT the engine publishes as
    # they are. Headroom for prediction error and the time the client sees outside the workers (~14 ms on the H200:
    # benchmarks/results/serve_h200_m2z). Off in the engine; 50 in the GPU deployments (deploy/gpu.yaml), measured
    # in the H200 serving runs since the twenty-fifth session (benchmarks/results/serve_h200_m3a ... m6)
    ttft_margin_ms: float = 0.0
    # what plans with ttft_margin_ms: "all" (default): the prefill queue's order, the batches' fit and the split
    # rule (the setting of the H200 A/B: at 40 req/s the rule judged TTFT at risk more often, kept decode on its
    # fewest SMs and TPOT misses rose); "order": the order and the batches' fit (and the decode side's order of
    # the mixed fallback's prompts) only, while the split rule judges TTFT risk and backlog against the real
    # targets (split_targets); unmeasured on a GPU
    ttft_margin_scope: str = "all"
    # a second, later TTFT target (ms; > ttft_target_ms; None, the default: off), e.g. the relaxed SLO's 1,000 beside
    # the strict 500: the prefill queue's least-slack order serves a request that can no longer make its target by
    # this one, in the slack the others leave (every request it passes still makes its target in the model), instead
    # of after everyone. Why: in a burst the margin deployment's late requests waited 1.4-3.4 s (TTFT p90 at 32-48
    # req/s, benchmarks/results/serve_h200_m4/), so they missed the relaxed SLO too. The planning margin shortens it
    # like the target. Only the order uses it; served once, beside max_on_time at one seed (serve_h200_m8: relaxed
    # 40.0 -> 42.67, strict 40.0 -> 36.0 req/s, within the bootstrap spread); benchmarks/replay_order.py --fallback-ms
    ttft_fallback_ms: float | None = None
    # with the split policy: how the prefill queue is ordered (bullet_ray.policy.ordering). "least_slack" (default):
    # the requests that can each still make their TTFT target, least slack first, the others after them.
    # "max_on_time": of those, only the most that can make their targets together, one after another (Moore and
    # Hodgson's rule for the fewest late jobs: in deadline order, the longest prompt so far is given up whenever the
    # one added would be late); the ones given up join the late ones. Why: least slack counts a request's own
    # prefill, not the queue ahead of it, so in a burst it serves requests that end up late anyway and their lateness
    # spreads to the ones behind (benchmarks/results/serve_h200_m7/: every bullet miss at 16-24 req/s a TTFT miss,
    # most at 32, 0.55-4.74 s late). Replayed on the m6 / m7 runs (benchmarks/results/replay_order_mot_h200/, two models): strict
    # attainment -0.2 to +1.7 points at 16-24 req/s, +0-7 at 32, +1-9 at 40, +6-17 at 48. Served on an H200 beside
    # least_slack in the same calls (benchmarks/results/serve_h200_m8/, two draws): strict goodput 1.09x and 1.23x,
    # relaxed 1.18x and 1.13x; every GPU deployment in deploy/ sets it (the CPU one keeps the fixed split).
    # "fallback_first": the same rule on ttft_fallback_ms first (the most requests that make the fallback target
    # together), then as many of those as can within their own target; the relaxed SLO counted first, for the long
    # prompts max_on_time gives up in a burst (bullet_ray.policy.ordering); it needs ttft_fallback_ms
    prefill_order: str = "least_slack"
    # with the split policy: while the prefill queue holds a request that misses its TTFT target whatever the split
    # (the split rule's backlog), a prefill batch may grow to this many prompt tokens (at most max_num_batched_tokens)
    # instead of stopping where the model says throughput has saturated; the batch's head still keeps its target
    # (the batches' fit). Larger steps run faster per token on a partition (the shipped H100 profile: 2,048 tokens on
    # 116 SMs 31.0k tokens/s, 8,192 36.3k), which a backlog needs more than the first tokens of a batch's members;
    # None (default): off. One H200 sample lost at strict (26.95 against 32.57 req/s: a batch's requests all wait
    # for the whole batch; benchmarks/results/serve_h200_m3c/, docs/policy.md twenty-seventh section)
    prefill_backlog_batch_tokens: int | None = None
    # with the split policy: a prefill batch stops growing at the fewest tokens whose throughput the performance model
    # puts within this share of the best (PerfModel.saturation_tokens; 0 < share <= 1): higher, larger batches (fewer
    # steps, more tokens/s, a batch's first requests wait longer). The measured H200 profile (2026-11-30) puts 95% at
    # 2.3-2.8k tokens on 92-116 SMs, where the derived one put 2.0-2.2k (benchmarks/results/serve_h200_m11/)
    prefill_saturation_share: float = SATURATION_SHARE
    # the GEMM of the projections (qkv, o, gate_up, down) of the worker that prefills (GPU): the prefill worker's on
    # the bullet and static schedules (tuned on its partitions where cuBLAS's grid wastes SM-rounds), the one worker's on the chunked
    # schedule (tuned on the whole GPU):
    # "cublas" (PyTorch's), "cublaslt" (at start, every algorithm cuBLASLt's heuristic offers, asked without
    # and with the partition's SM count as target, the first few also with 1x1 / 1x2 / 2x1 clusters, is timed per
    # partition, projection shape and token count against F.linear and the fastest kept, cached per device in
    # ~/.cache/bullet_ray/lt_gemm.json: bullet_ray.engine.lt_gemm), "cublaslt-all" (also a bounded enumeration of
    # configurations with 1x1 and 1x2 clusters the heuristic never offers), "auto" (default): cublaslt on the
    # bullet and static schedules' prefill worker on a GPU in bfloat16, cublas otherwise (`prefill_gemm_mode`).
    # Why: cuBLAS's kernels are sized for the whole GPU and ran a 2,048-token step 28-42% slower on 84-124 SMs of an
    # H200 (docs/policy.md); tuned, the step on 116 SMs took 56.8 ms instead of 65.4 and bullet-slo-margin50's goodput
    # rose 1.14x strict / 1.16x relaxed in one run (benchmarks/results/serve_h200_m5/); on the whole GPU (chunked)
    # it gained nothing offline (0.955x vLLM against cuBLAS's 0.959x, benchmarks/results/offline_h200_m5/)
    prefill_gemm: str = "auto"
    # settings of the split rule (fields of bullet_ray.policy.split.SplitSettings: aim, hold_below,
    # max_shrink, min_dwell_s, idle_margin, backlog_aim, idle_decode; docs/policy.md); None: its defaults
    split_rule: dict | None = None
    # append one JSON line per step (phase, tokens, batch, context, split, predicted and measured device time,
    # the host's plan / metadata / launch / gap times), per split decision and per completed switch to this
    # file (every worker; None: no log); benchmarks/plot_steps.py plots it
    step_log_path: str | None = None
    # profile a window of every worker's steps (cProfile of the host loop, torch.profiler of the ops and
    # kernels) into this folder (bullet_ray.engine.worker.step_profile; None: no profiling): the steps
    # profile_start_step (>= 0, counted from each worker's first step) to + profile_num_steps (>= 1) - 1
    profile_dir: str | None = None
    profile_start_step: int = 200
    profile_num_steps: int = 50
    # each worker freezes its heap once started (bullet_ray.engine.gc_pauses.freeze_heap: every object alive then is
    # moved to the permanent generation, which no garbage collection walks, as vLLM's engine core and workers do), so
    # that no oldest-generation pass over the model's and graphs' objects holds up the host while serving, and so does
    # the Serve replica that runs the engine front once the engine has started (as vLLM's API server does); the step
    # log times every collection either way (`gc_ms`), the metrics each process's (`gc_pause_seconds`)
    gc_freeze: bool = True
    # decode worker polls this often when idle (ms)
    idle_poll_ms: float = 2.0
    # folder for this engine's sockets and shared-memory files; None: a fresh one under /dev/shm or /tmp
    runtime_dir: str | None = None

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; choose one of {DTYPES}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError("device", f"unknown device {self.device!r}; use 'cpu' or 'cuda'")
        if self.block_size < 1:
            raise ConfigError("block_size", f"must be >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks", f"must be >= 1 or null, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ConfigError("kv_cache_memory_gb", f"must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError("max_model_len", f"must be >= 2 or null, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.block_size:
            raise ConfigError("max_num_batched_tokens",
                              f"must be >= block_size ({self.block_size}), got {self.max_num_batched_tokens}")
        if self.piecewise_graph_tokens is not None and self.piecewise_graph_tokens < 0:
            raise ConfigError("piecewise_graph_tokens", f"must be >= 0 (0: off), got {self.piecewise_graph_tokens}")
        if not 0.0 <= self.kv_watermark <= 0.5:
            raise ConfigError("kv_watermark", f"must be in [0, 0.5], got {self.kv_watermark}")
        if self.split_policy not in ("auto", "slo", "fixed"):
            raise ConfigError("split_policy", f"unknown split policy {self.split_policy!r}; choose auto, slo or fixed")
        if not 1 <= self.prefill_layer_groups <= MAX_PREFILL_LAYER_GROUPS:
            raise ConfigError("prefill_layer_groups", f"must be in [1, {MAX_PREFILL_LAYER_GROUPS}], got "
                              f"{self.prefill_layer_groups} (1: whole prefill forward)")
        if self.prefill_layer_group_min_tokens < 1:
            raise ConfigError("prefill_layer_group_min_tokens",
                              f"must be >= 1, got {self.prefill_layer_group_min_tokens}")
        if not 1 <= self.decode_pieces <= MAX_PREFILL_LAYER_GROUPS:
            raise ConfigError("decode_pieces", f"must be in [1, {MAX_PREFILL_LAYER_GROUPS}], got {self.decode_pieces} "
                              "(1: a decode step is one graph)")
        if self.decode_pieces > 1 and self.uses_split_policy and self.split_switch != "overlap":
            raise ConfigError("decode_pieces", f"{self.decode_pieces} pieces need split_switch: overlap (a disjoint "
                              "switch's ack promises the side's SMs are free, which a step in flight cannot keep)")
        if self.piecewise_buckets not in ("tuned", "fixed"):
            raise ConfigError("piecewise_buckets", f"unknown bucket choice {self.piecewise_buckets!r}; choose tuned or fixed")
        if self.split_switch not in SPLIT_SWITCHES:
            raise ConfigError("split_switch", f"unknown split switch {self.split_switch!r}; choose disjoint or overlap")
        if self.handoff not in HANDOFFS:
            raise ConfigError("handoff", f"unknown hand-off {self.handoff!r}; choose front or direct")
        if self.prefill_plan_lead_ms is not None and not self.prefill_plan_lead_ms >= 0:
            raise ConfigError("prefill_plan_lead_ms", f"must be >= 0 or null, got {self.prefill_plan_lead_ms}")
        if self.prefill_idle_decide_ms is not None and not 0 < self.prefill_idle_decide_ms <= 500:
            raise ConfigError("prefill_idle_decide_ms",
                              f"must be > 0 and <= 500 (the idle wait) or null, got {self.prefill_idle_decide_ms}")
        if self.prefill_backlog_batch_tokens is not None and self.prefill_backlog_batch_tokens < 1:
            raise ConfigError("prefill_backlog_batch_tokens",
                              f"must be >= 1 or null, got {self.prefill_backlog_batch_tokens}")
        if not 0 < self.prefill_saturation_share <= 1:
            raise ConfigError("prefill_saturation_share", f"must be > 0 and <= 1, got {self.prefill_saturation_share}")
        if self.prefill_gemm not in PREFILL_GEMMS:
            raise ConfigError("prefill_gemm", f"unknown GEMM {self.prefill_gemm!r}; choose {', '.join(PREFILL_GEMMS)}")
        if self.prefill_gemm not in ("auto", "cublas") and not self.is_gpu:
            raise ConfigError("prefill_gemm", f"{self.prefill_gemm} runs cuBLASLt: it needs a GPU (device "
                              f"{self.device})")
        if self.prefill_gemm not in ("auto", "cublas") and self.dtype not in ("auto", "bfloat16"):
            raise ConfigError("prefill_gemm", f"{self.prefill_gemm} runs bfloat16 GEMMs (dtype {self.dtype})")
        if self.mixed_fallback_tokens is not None and self.mixed_fallback_tokens < 1:
            raise ConfigError("mixed_fallback_tokens", f"must be >= 1 or null, got {self.mixed_fallback_tokens}")
        if self.mixed_chunk_tokens < self.block_size:
            raise ConfigError("mixed_chunk_tokens",
                              f"must be >= block_size ({self.block_size}), got {self.mixed_chunk_tokens}")
        if self.split_rule is not None:
            self.split_settings()  # unknown or out-of-range settings fail here, naming the field
        for name in ("ttft_target_ms", "tpot_target_ms"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, f"must be > 0, got {getattr(self, name)}")
        per_token = self.ttft_target_ms_per_prompt_token
        if per_token is not None and not per_token > 0:
            raise ConfigError("ttft_target_ms_per_prompt_token", f"must be > 0 or null (off), got {per_token}")
        if not 0 <= self.ttft_margin_ms < math.inf:
            raise ConfigError("ttft_margin_ms", f"must be >= 0 and finite, got {self.ttft_margin_ms}")
        if per_token is None and not self.ttft_margin_ms < self.ttft_target_ms:
            # with per-prompt-token targets ttft_target_ms is only their floor (1.5-3 ms in Bullet's presets): a
            # target never goes under a tenth of itself (SloTargets), so no bound on the floor is needed there
            raise ConfigError("ttft_margin_ms", f"must be < ttft_target_ms ({self.ttft_target_ms:g}), "
                              f"got {self.ttft_margin_ms}")
        fallback = self.ttft_fallback_ms
        if fallback is not None and not (self.ttft_target_ms < fallback < math.inf):
            raise ConfigError("ttft_fallback_ms", f"must be > ttft_target_ms ({self.ttft_target_ms:g}) and finite, "
                                                  f"or null (off), got {fallback}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ConfigError("prefill_order", f"unknown prefill order {self.prefill_order!r}; choose least_slack "
                              "(the default), max_on_time (the most requests that make their targets together) or "
                              "fallback_first (the most that make ttft_fallback_ms, as many of them as can their target)")
        if self.prefill_order == "fallback_first" and self.ttft_fallback_ms is None:
            raise ConfigError("prefill_order", "fallback_first orders the queue by the fallback TTFT target: set "
                              "ttft_fallback_ms (e.g. 1000) or choose max_on_time")
        if self.ttft_margin_scope not in TTFT_MARGIN_SCOPES:
            raise ConfigError("ttft_margin_scope", f"unknown margin scope {self.ttft_margin_scope!r}; choose all "
                              "(order, batch fit and split rule) or order (order and batch fit only)")
        if self.profile_start_step < 0:
            raise ConfigError("profile_start_step", f"must be >= 0, got {self.profile_start_step}")
        if self.profile_num_steps < 1:
            raise ConfigError("profile_num_steps", f"must be >= 1, got {self.profile_num_steps}")
        counts = self.decode_sm_counts
        if counts is not None:
            problem = ladder_problem(counts)
            if problem is not None:
                raise ConfigError("decode_sm_counts", problem)
            if self.partition == "mps":
                raise ConfigError("decode_sm_counts", "the mps partition backend has one fixed split (each side's "
                                                      "active thread percentage), no ladder; use green or auto")
            object.__setattr__(self, "decode_sm_counts", tuple(counts))  # a YAML list: a tuple, as the field says
        if self.partition not in ("auto", "green", "mps", "none"):
            raise ConfigError("partition", f"unknown partition backend {self.partition!r}; "
                              "choose auto, green, mps or none")

    @property
    def is_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.is_gpu else "float32"

    @property
    def attention_backend_name(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "flashinfer" if self.is_gpu else "torch"

    @property
    def uses_mixed_fallback(self) -> bool:
        """The bullet schedule's mixed fallback is on (`mixed_fallback_tokens` with the slo split policy)."""
        return self.uses_split_policy and self.mixed_fallback_tokens is not None

    def piecewise_limit(self, role: str) -> int:
        """The largest step with prompt tokens that runs through piecewise graphs on a worker of `role`
        (0: none); `piecewise_graph_tokens`' comment says why a prefill side holds less by default. A decode
        side holds the mixed fallback's steps (on its whole-GPU entry only)."""
        if role == "decode":
            return self.mixed_chunk_tokens if self.uses_mixed_fallback else 0
        if self.piecewise_graph_tokens is not None:
            return min(self.piecewise_graph_tokens, self.max_num_batched_tokens)
        return self.max_num_batched_tokens if role == "hybrid" else min(2048, self.max_num_batched_tokens)

    def slo_targets(self) -> SloTargets:
        """The SLO targets (seconds) from `ttft_target_ms`, `tpot_target_ms` and
        `ttft_target_ms_per_prompt_token`: what the SLO metrics judge by."""
        from bullet_ray.policy.slo import SloTargets

        per_token = self.ttft_target_ms_per_prompt_token
        fallback = self.ttft_fallback_ms
        return SloTargets(self.ttft_target_ms / 1e3, self.tpot_target_ms / 1e3,
                          None if per_token is None else per_token / 1e3,
                          fallback_ttft_s=None if fallback is None else fallback / 1e3)

    def planning_targets(self) -> SloTargets:
        """The targets the split policy plans for: `slo_targets` with `ttft_margin_ms` taken off each TTFT
        target (SloTargets.margin_s; the same as `slo_targets` at margin 0)."""
        return dataclasses.replace(self.slo_targets(), margin_s=self.ttft_margin_ms / 1e3)

    def split_targets(self) -> SloTargets:
        """The targets the split rule judges TTFT risk and backlog by: `planning_targets` (the margin) with
        ttft_margin_scope "all", `slo_targets` (the real targets) with "order"."""
        return self.planning_targets() if self.ttft_margin_scope == "all" else self.slo_targets()

    def split_settings(self) -> Any:
        """The split rule's SplitSettings from `split_rule`."""
        from bullet_ray.policy.split import SplitSettings

        rule = dict(self.split_rule or {})
        unknown = sorted(set(rule) - {f.name for f in dataclasses.fields(SplitSettings)})
        if unknown:
            raise ConfigError("split_rule", f"unknown setting(s) {unknown}; see bullet_ray.policy.split.SplitSettings")
        try:
            return SplitSettings(**rule)
        except TypeError as e:
            raise ConfigError("split_rule", str(e)) from None

    def bullet_policy(self, model: PerfModel, decode_sms: list[int], sm_count: int) -> BulletPolicy:
        """The split policy these settings make (bullet_ray.policy.bullet.BulletPolicy) over a ladder of `decode_sms` on
        `sm_count` SMs: the one the prefill worker decides with (SplitDecider) and the one replay_split replays."""
        from bullet_ray.policy.bullet import BulletPolicy

        return BulletPolicy(model, list(decode_sms), sm_count, self.planning_targets(),
                            token_cap=self.max_num_batched_tokens, settings=self.split_settings(),
                            split_targets=self.split_targets(), backlog_batch_tokens=self.prefill_backlog_batch_tokens,
                            prefill_order=self.prefill_order, saturation_share=self.prefill_saturation_share)

    @property
    def uses_split_policy(self) -> bool:
        """True when the workers move the SM split step by step (bullet schedule, policy slo)."""
        return self.schedule == "bullet" and self.split_policy == "slo"

    @property
    def prefill_gemm_mode(self) -> str:
        """`prefill_gemm` with "auto" resolved (`resolve_prefill_gemm`)."""
        return resolve_prefill_gemm(self.prefill_gemm, self.is_gpu, self.torch_dtype_name, self.schedule)

    @property
    def is_async_scheduling(self) -> bool:
        return self.is_gpu if self.async_scheduling is None else self.async_scheduling

    @property
    def is_disaggregated(self) -> bool:
        """True when prefill and decode run in two worker processes (bullet, static)."""
        return self.schedule in ("bullet", "static")

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
