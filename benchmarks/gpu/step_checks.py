"""GPU checks of the step path that engine_speed.py adds to its JSON: kernels per step, and the chunked
schedule's CUDA graphs against eager.

`kernel_counts`: one step under torch.profiler: GPU kernels run, host launch calls made (a graph replay
is one cudaGraphLaunch for all its kernels), and GPU time, for an eager decode step, the same step
through the decode graphs, a chunked mixed step (decodes + a prompt chunk) and a prefill step.

`chunked_graphs_vs_eager`: the chunked schedule (ChunkedScheduler) with asynchronous launch/collect run
twice on the same prompts and weights: once with decode graphs (decode-only steps replay them), once
eager. Greedy tokens must agree; the graph side must capture nothing after its start-up capture.

    python -m benchmarks.gpu.step_checks        # alone; engine_speed.py calls both
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu.engine_common import make_runner
from bullet_ray.engine.scheduler.base import ScheduledSeq

BLOCK = 16


class _Blocks:
    """A plain free list (the engine's is shared memory; one process needs none of that)."""

    def __init__(self, n: int) -> None:
        self.free_ids = list(range(n))
        self.num_blocks = n

    @property
    def num_free(self) -> int:
        return len(self.free_ids)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_ids):
            return None
        out, self.free_ids = self.free_ids[-n:] if n else [], self.free_ids[:len(self.free_ids) - n]
        return out

    def free(self, ids: list[int]) -> None:
        self.free_ids.extend(ids)


@torch.inference_mode()
def kernel_counts(fn: Callable[[], Any]) -> dict[str, Any]:
    """Kernels and host launch calls of one call of fn (after two warm-up calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()

    def own_us(e: Any) -> float:  # a kernel's own GPU time; 0 for host-side ops (their kernels are rows too)
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

    rows = prof.key_averages()
    host = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cudaMemcpyAsync",
            "cudaStreamSynchronize", "cudaEventSynchronize")
    # gpu_kernels counts every GPU activity with its own time (kernels, and the step's few input copies)
    return {"gpu_kernels": sum(e.count for e in rows if own_us(e) > 0),
            "host_calls": {e.key: e.count for e in rows if e.key.startswith(host)},
            "gpu_ms": round(sum(own_us(e) for e in rows) / 1e3, 3)}


def _seqs(lengths: list[int], max_tokens: int, vocab: int = 30100, logprobs: int | None = None) -> list[Any]:
    from bullet_ray.engine.sampler import SamplingState
    from bullet_ray.engine.sampling_params import SamplingParams
    from bullet_ray.engine.sequence import Sequence

    seqs, block = [], 0
    for i, n in enumerate(lengths):
        ids = [(i * 7919 + j * 104729) % (vocab - 100) + 100 for j in range(n)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
        seq = Sequence(f"r{i}", ids, SamplingState(params, list(ids)), 0.0, 1 << 20)
        per = (n + max_tokens + BLOCK - 1) // BLOCK
        seq.block_ids = list(range(block, block + per))
        block += per
        seqs.append(seq)
    return seqs


@torch.inference_mode()
def step_kernel_counts(model: Any, cfg: Any) -> dict[str, Any]:
    """Kernel counts of four step shapes (batch 64 x context 1024 decode; 32 decodes + a 2,016-token chunk;
    a 2,048-token prefill)."""
    from bullet_ray.engine.cuda_graphs import DecodeGraphs

    runner, kv = make_runner(model, cfg, "flashinfer", 8192, BLOCK, "cuda", torch.bfloat16)
    kv.normal_()
    out: dict[str, Any] = {}
    decode = _seqs([1024] * 64, 1)
    for s in decode:
        s.num_computed_tokens = 1023
    batch = [ScheduledSeq(s, 1) for s in decode]

    def run(batch: list[ScheduledSeq]) -> Callable[[], Any]:
        def step() -> Any:
            saved = [(item.seq.num_computed_tokens, item.seq.num_pending_tokens) for item in batch]
            runner.collect(runner.launch(batch))
            for item, (computed, pending) in zip(batch, saved):
                item.seq.num_computed_tokens, item.seq.num_pending_tokens = computed, pending
                item.seq.output_token_ids.clear()
        return step

    out["decode_bs64_ctx1024_eager"] = kernel_counts(run(batch))
    runner.graphs = DecodeGraphs(model, runner.backend, BLOCK, 64, 4096 // BLOCK, torch.device("cuda"))
    runner.graphs.capture_all(0)
    out["decode_bs64_ctx1024_graph"] = kernel_counts(run(batch))
    mixed = _seqs([1024] * 32 + [2016], 1)
    for s in mixed[:32]:
        s.num_computed_tokens = 1023
    out["mixed_32_decodes_plus_2016_chunk"] = kernel_counts(run(
        [ScheduledSeq(s, 1) for s in mixed[:32]] + [ScheduledSeq(mixed[32], 2016)]))
    out["prefill_2048"] = kernel_counts(run([ScheduledSeq(s, 1024) for s in _seqs([1024, 1024], 1)]))
    return out


# the chunked check's prompt lengths: short and long rows, some chunked across steps by its 512-token budget
CHUNKED_CHECK_LENGTHS = (40, 300, 1200, 77, 650, 2000, 15, 900)


@torch.inference_mode()
def chunked_graphs_vs_eager(model: Any, cfg: Any, num_new: int = 48, device: str = "cuda",
                            lengths: list[int] | None = None) -> dict[str, Any]:
    """Greedy tokens of the chunked schedule with decode graphs vs eager (asynchronous launch/collect), with each
    token's margin over the runner-up (top-2 logprobs: the sampler's float32 path, whose argmax is the bf16 one's):
    where two rows part, a margin near 0 says a near tie flipped, a large one a wrong result.
    On CPU (a smoke test of this loop) both sides run eager with the torch backend."""
    from bullet_ray.engine.cuda_graphs import DecodeGraphs
    from bullet_ray.engine.scheduler.chunked import ChunkedScheduler

    lengths = lengths or list(CHUNKED_CHECK_LENGTHS)
    on_gpu = device.startswith("cuda")
    tokens: dict[str, list[list[int]]] = {}
    margins: dict[str, list[list[float | None]]] = {}  # per run and row, each token's top-1 minus top-2 logprob
    info: dict[str, Any] = {}
    for name in ("graph", "eager"):
        runner, kv = make_runner(model, cfg, "flashinfer" if on_gpu else "torch", 2048, BLOCK, device,
                                 torch.bfloat16 if on_gpu else torch.float32)
        if name == "graph" and on_gpu:
            runner.graphs = DecodeGraphs(model, runner.backend, BLOCK, 16, 4096 // BLOCK, torch.device("cuda"))
            runner.graphs.capture_all(0)
            runner.graphs.is_serving = True
        sched = ChunkedScheduler(_Blocks(2048), BLOCK, 512, 16)
        seqs = _seqs(lengths, num_new, cfg.vocab_size, logprobs=2)
        row_margins: dict[str, list[float | None]] = {seq.request_id: [] for seq in seqs}
        for s in seqs:
            s.block_ids = []
            sched.add(s)
        inflight, steps, decode_only = None, 0, 0
        while sched.num_waiting + sched.num_running or inflight is not None:
            batch = sched.schedule()
            step = runner.launch(batch) if batch else None
            if step is not None:
                steps += 1
                decode_only += all(item.num_new_tokens == 1 for item in batch)
                sched.after_step(step.sampled)
            if inflight is not None:
                result = runner.collect(inflight)
                for seq in result.sampled:
                    lp = result.logprobs.get(seq.request_id)
                    row_margins[seq.request_id].append(
                        round(lp.top[0][1] - lp.top[1][1], 5) if lp is not None and len(lp.top) >= 2 else None)
                    if seq.check_finished(seq.output_token_ids[-1], ()):
                        sched.finish(seq)
            inflight = step
        tokens[name] = [list(s.output_token_ids) for s in seqs]
        margins[name] = [row_margins[s.request_id] for s in seqs]
        info[name] = {"steps": steps, "decode_only_steps": decode_only}
        if runner.graphs is not None:
            info[name]["num_captures_serving"] = runner.graphs.num_captures_serving
        del runner, kv
    rows_equal = [a == b for a, b in zip(tokens["graph"], tokens["eager"])]
    agree = sum(x == y for a, b in zip(tokens["graph"], tokens["eager"]) for x, y in zip(a, b))
    total = sum(len(a) for a in tokens["eager"])
    # per row, the first output token where the two runs part (None: equal): greedy decoding follows its own tokens,
    # so everything after it differs by construction; how early it comes says more than the agreement share
    first_divergence = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                        for a, b in zip(tokens["graph"], tokens["eager"])]
    # at each row's parting token: the margin each run had there (nats); and the least margin of the eager run's
    # tokens up to it (the row's closest call)
    at_divergence = [None if i is None else {run: margins[run][row][i] if i < len(margins[run][row]) else None
                                             for run in ("graph", "eager")}
                     for row, i in enumerate(first_divergence)]
    least = [min((m for m in ms[:None if i is None else i + 1] if m is not None), default=None)
             for ms, i in zip(margins["eager"], first_divergence)]
    return {"prompt_lengths": lengths, "new_tokens": num_new, "tokens_equal": all(rows_equal),
            "rows_equal": rows_equal, "first_divergence": first_divergence, "margin_at_divergence": at_divergence,
            "least_margin_eager": least, "token_agreement": round(agree / total, 4), **info}


def main() -> int:
    from benchmarks.gpu.common import save
    from bullet_ray.models.loader import load_model

    loaded = load_model("dummy:llama-3.1-8b", dtype=torch.bfloat16, device="cuda", show_progress=False)
    result = {"kernels_per_step": step_kernel_counts(loaded.model, loaded.config),
              "chunked_graphs_vs_eager": chunked_graphs_vs_eager(loaded.model, loaded.config)}
    print(result)
    save("gpu_step_checks_h100", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
