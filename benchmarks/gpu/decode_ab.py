"""Decode step times of whichever bullet_ray is first on PYTHONPATH, for before/after comparisons of the
decode path on one machine (run it once per tree, in the same device call): eager step, graph step one at
a time (host plan inside the timed span), graph steps back to back, and the host's plan time per step.
Dummy Llama-3.1-8B, context 1k, batch 1 / 16 / 64.

    git archive <old-commit> bullet_ray | tar x -C /tmp/old
    PYTHONPATH=/tmp/old:$PWD python benchmarks/gpu/decode_ab.py     # the old tree
    PYTHONPATH=$PWD python benchmarks/gpu/decode_ab.py              # this tree
"""

from __future__ import annotations

import time

import torch

import bullet_ray
from benchmarks.gpu.common import time_back_to_back, time_cuda
from benchmarks.gpu.engine_common import make_runner
from benchmarks.gpu.engine_speed import BLOCK, _seqs, forward_ms
from bullet_ray.engine.cuda_graphs import DecodeGraphs
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.models.loader import load_model


def main() -> None:
    print("bullet_ray from", bullet_ray.__file__)
    loaded = load_model("dummy:llama-3.1-8b", dtype=torch.bfloat16, device="cuda")
    runner, _ = make_runner(loaded.model, loaded.config, "flashinfer", 20000, BLOCK, "cuda", torch.bfloat16)
    graphs = DecodeGraphs(runner.model, runner.backend, BLOCK, 256, (4096 + 2 * BLOCK) // BLOCK + 1,
                          torch.device("cuda"))
    with torch.inference_mode():
        for bs in (1, 16, 64):
            seqs = _seqs(bs, 1024, 1)
            for s in seqs:
                s.num_computed_tokens = 1023
            batch = [ScheduledSeq(s, 1) for s in seqs]
            eager = forward_ms(runner, batch)
            ids, pos, md = runner.build_metadata(batch)
            tables = [s.block_ids[:64] for s in seqs]

            def step(ids=ids, pos=pos, md=md, tables=tables):
                return runner.model.compute_logits(graphs.run(0, ids, pos, md, tables))

            serial = time_cuda(step, iters=20, warmup=3)
            pipelined = time_back_to_back(step, iters=30, warmup=3)
            start = time.perf_counter()
            for _ in range(50):
                graphs._plan(graphs.bucket(bs), tables, md.seq_lens_list)
            torch.cuda.synchronize()
            plan_us = (time.perf_counter() - start) / 50 * 1e6
            print(f"bs{bs}: eager {eager:.3f} ms, graph serial {serial:.3f} ms, pipelined {pipelined:.3f} ms, "
                  f"plan {plan_us:.0f} us", flush=True)


if __name__ == "__main__":
    main()
