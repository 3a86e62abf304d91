"""`bullet-ray profile`'s measurements: the engine's model and runner, driven step by step on each ladder entry.

On a GPU: ceilings first (bf16 GEMM on the whole GPU; a decode-like GEMV on the whole GPU and on every
ladder entry's decode side, to which the bandwidth curve's saturation_sms and knee are fitted), then for
every ladder entry, on its green-context streams (one process makes both sides, as GPU.md's complementary
pairs): prefill steps (tokens x cached context) on the prefill side and decode steps (batch x context per
sequence, through the decode CUDA graphs as the engine runs them) on the decode side, each alone and with
the other side busy (the other side's steps queued on its stream first, enough to outlast the measured
step). A step's time is its wall time: host metadata + forward + lm_head + stream sync, as the engine's
workers measure theirs. On a CPU: the same steps on one "entry" (no ladder, nothing to run beside).

torch is imported inside the functions: the model (bullet_ray.perf) stays importable without it.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bullet_ray.perf.kernels import StepShape
from bullet_ray.perf.profile import Sample
from bullet_ray.perf.roofline import GpuSpec

logger = logging.getLogger(__name__)

LONG_STEP_S = 0.2  # steps longer than this are timed 3 times (median), not `repeats`


@dataclass(frozen=True)
class SweepPlan:
    prefill_tokens: tuple[int, ...]  # new tokens per prefill step
    prefill_cached: tuple[int, ...]  # cached prefix per prompt (0: fresh prompts; >0: a later chunk)
    prompt_len: int  # a prefill step holds prompts of at most this many new tokens
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # KV tokens per sequence
    busy: tuple[bool, ...]  # alone, and with the other side busy
    repeats: int = 5
    warmup: int = 2

    @classmethod
    def gpu(cls, quick: bool = False) -> SweepPlan:
        if quick:
            return cls((256, 1024, 4096), (0,), 2048, (1, 16, 64), (1024,), (False, True), 3, 1)
        return cls((128, 256, 512, 1024, 2048, 4096, 8192), (0, 2048), 2048, (1, 8, 16, 32, 64, 128, 256),
                   (256, 1024, 4096), (False, True))

    @classmethod
    def cpu(cls, quick: bool = False) -> SweepPlan:
        if quick:
            return cls((8, 64), (0,), 64, (1, 4), (64,), (False,), 3, 1)
        return cls((8, 16, 32, 64, 128), (0, 64), 64, (1, 2, 4, 8), (16, 64, 256), (False,), 7, 2)


def _time_s(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, warmup: int,
            best: bool = False) -> float:
    """Median wall time of `repeats` runs after `warmup` (`best`: the fastest, for a shared CPU where
    other processes only ever add time)."""
    slow = False
    for _ in range(warmup):
        t0 = time.perf_counter()
        fn()
        sync()
        slow = time.perf_counter() - t0 > LONG_STEP_S
    if slow:
        repeats = min(repeats, 3)  # long steps vary little; the sweep's time goes to them
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times) if best else statistics.median(times)


def fit_bandwidth_curve(sm_count: int, points: dict[int, float]) -> tuple[float, float]:
    """(saturation_sms, knee) of the roofline's bandwidth curve that best fits measured GB/s by SM count
    (relative least squares over a grid; the whole device's point normalizes the curve)."""
    whole = points[sm_count]
    best = (math.inf, sm_count / 4, 2.0)
    for sat10 in range(20, 10 * sm_count, max(1, sm_count // 26)):
        sat = sat10 / 10
        for knee10 in range(5, 61):
            spec = GpuSpec("fit", sm_count, 1.0, whole, sat, knee10 / 10)
            err = sum((spec.bandwidth_bytes_per_s(n) / 1e9 / gbs - 1) ** 2 for n, gbs in points.items())
            if err < best[0]:
                best = (err, sat, knee10 / 10)
    return best[1], best[2]


class Bench:
    """The model, a KV tensor and a runner on one device; builds batches and times steps."""

    def __init__(self, model_source: str, device: str, dtype_name: str, kv_fraction: float = 0.7,
                 block_size: int = 16, use_graphs: bool = True, max_batch: int = 256, max_len: int = 16384) -> None:
        import torch

        from bullet_ray.engine.attention.base import get_backend_class
        from bullet_ray.engine.kv_pool import SCRATCH_BLOCKS
        from bullet_ray.engine.runner import ModelRunner
        from bullet_ray.engine.sampler import Sampler
        from bullet_ray.models.loader import load_model

        self.torch = torch
        self.device = device
        if not device.startswith("cuda"):
            from bullet_ray.engine.worker.main import available_cores, cpu_threads

            # as the engine runs a bullet side beside a busy other side
            torch.set_num_threads(cpu_threads("prefill", available_cores(), other_busy=True))
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype_name]
        loaded = load_model(model_source, dtype=self.dtype, device=device, show_progress=True)
        self.model, self.cfg = loaded.model, loaded.config
        self.block_size = block_size
        cfg, bs = self.cfg, block_size
        per_block = cfg.kv_bytes_per_token(self.dtype.itemsize) * bs
        if device.startswith("cuda"):
            free = torch.cuda.mem_get_info()[0]
            num_blocks = int(max(free * kv_fraction - (4 << 30), per_block * 64) // per_block)
        else:
            num_blocks = 4096
        self.num_blocks = num_blocks
        # past num_blocks: the decode graphs' scratch block, as the engine's KVPool keeps one
        self.kv = torch.empty(cfg.num_hidden_layers, num_blocks + SCRATCH_BLOCKS, 2, bs, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=self.dtype, device=device)
        self.kv.normal_(0.0, 0.1)  # in place: the pool is most of the free memory; never time on zeros
        backend = "flashinfer" if device.startswith("cuda") else "torch"
        be = get_backend_class(backend)(self.kv, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.head_dim ** -0.5)
        self.runner = ModelRunner(self.model, be, Sampler(), bs, device)
        if use_graphs and device.startswith("cuda"):
            from bullet_ray.engine.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.model, be, bs, max_batch, (max_len + bs - 1) // bs,
                                              torch.device(device), scratch_slot=num_blocks * bs)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def batch(self, num_seqs: int, new_tokens: int, cached: int, first_block: int = 0) -> list[Any]:
        """ScheduledSeqs of `num_seqs` sequences, each with `cached` tokens in the pool and `new_tokens` to run
        (blocks assigned round the pool from `first_block`: contents do not matter, distinct addresses do)."""
        from bullet_ray.engine.sampler import SamplingState
        from bullet_ray.engine.sampling_params import SamplingParams
        from bullet_ray.engine.scheduler.base import ScheduledSeq
        from bullet_ray.engine.sequence import Sequence

        bs, total = self.block_size, cached + new_tokens
        per = (total + bs - 1) // bs
        out, next_block = [], first_block
        for i in range(num_seqs):
            ids = [((i * 7 + j) % 1000 + 10) % self.cfg.vocab_size for j in range(total)]
            seq = Sequence(f"p{i}", ids, SamplingState(SamplingParams(temperature=0.0, max_tokens=1), ids), 0.0,
                           1 << 20)
            seq.block_ids = [(next_block + k) % self.num_blocks for k in range(per)]
            next_block += per
            seq.num_computed_tokens = cached
            out.append(ScheduledSeq(seq, new_tokens))
        return out

    def step_fn(self, batch: list[Any], graph_key: int) -> Callable[[], Any]:
        """One step as the runner runs it (`ModelRunner.forward`: metadata, a decode graph where one holds the batch,
        else eager: this runner has no piecewise graphs) on ladder entry `graph_key`, then the lm_head on each
        sequence's last row; no sampling."""
        runner, torch = self.runner, self.torch

        @torch.inference_mode()
        def run() -> Any:
            runner.graph_key = graph_key
            fwd = runner.forward(batch)
            last = fwd.metadata.query_start_loc[1:].long() - 1
            return runner.model.compute_logits(fwd.hidden.index_select(0, last))

        return run


def prefill_points(plan: SweepPlan, capacity: int) -> list[tuple[int, int, int]]:
    """(num_seqs, new tokens per seq, cached per seq) of every prefill point that fits the pool."""
    out = []
    for tokens in plan.prefill_tokens:
        per = min(tokens, plan.prompt_len)
        seqs = max(1, tokens // per)
        for cached in plan.prefill_cached:
            if seqs * (per + cached) <= capacity:
                out.append((seqs, per, cached))
    return out


def decode_points(plan: SweepPlan, capacity: int) -> list[tuple[int, int]]:
    return [(b, c) for b in plan.decode_batches for c in plan.decode_contexts if b * (c + 16) <= capacity]


def sample_of(phase: str, batch: list[Any], sms: int, busy: bool, seconds: float) -> Sample:
    tokens = sum(i.num_new_tokens for i in batch)
    ctx = sum(i.seq.num_computed_tokens + i.num_new_tokens for i in batch)
    pairs = sum(i.num_new_tokens * (i.seq.num_computed_tokens + i.num_new_tokens)
                - i.num_new_tokens * (i.num_new_tokens - 1) // 2 for i in batch)
    shape = StepShape(phase, tokens, len(batch), ctx, pairs)  # type: ignore[arg-type]
    return Sample(shape.phase, shape.num_tokens, shape.num_seqs, shape.num_context_tokens,
                  shape.num_attention_pairs, sms, busy, seconds)


def gemm_tflops(torch: Any, device: str, dtype: Any, n: int, stream: Any = None) -> float:
    """Dense matmul throughput of an n^3 GEMM (on `stream` if given)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)

    def run() -> None:
        if stream is None:
            a @ b
        else:
            with torch.cuda.stream(stream):
                a @ b

    return 2 * n ** 3 / _time_s(run, sync, 5, 2) / 1e12


def gemv_gbs(torch: Any, device: str, dtype: Any, rows: int = 64, k: int = 4096, n: int = 14336,
             copies: int = 4, stream: Any = None) -> float:
    """A decode-like GEMV's bandwidth (weights rotated past the cache; GB/s counting weights, input, output)."""
    ws = [torch.randn(k, n, device=device, dtype=dtype) for _ in range(copies)]
    x = torch.randn(rows, k, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize()) if device.startswith("cuda") else (lambda: None)
    state = {"i": 0}

    def run() -> None:
        w = ws[state["i"] % copies]
        state["i"] += 1
        if stream is None:
            x @ w
        else:
            with torch.cuda.stream(stream):
                x @ w

    nbytes = (k * n + rows * k + rows * n) * x.element_size()
    return nbytes / _time_s(run, sync, 10, 3) / 1e9
