"""Is CUDA-graph decode the same computation as eager decode on Llama-3.1-8B (dummy weights)?

Eager here uses the same CUDA-core flashinfer decode kernel as the graphs, so any difference beyond
rounding would be a bug (stale plan, wrong padding, wrong buffers). Mixed context lengths per batch.

    python -m benchmarks.gpu.graph_check
"""

from __future__ import annotations

import sys

import flashinfer
import torch

from benchmarks.gpu.common import save
from benchmarks.gpu.engine_common import make_runner
from benchmarks.gpu.engine_speed import BLOCK, _seqs
from bullet_ray.engine.attention.base import AttentionContext
from bullet_ray.engine.cuda_graphs import DecodeGraphs
from bullet_ray.engine.scheduler.base import ScheduledSeq
from bullet_ray.models.loader import load_model


@torch.inference_mode()
def main() -> int:
    loaded = load_model("dummy:llama-3.1-8b", dtype=torch.bfloat16, device="cuda", show_progress=False)
    runner, kv = make_runner(loaded.model, loaded.config, "flashinfer", 4096, BLOCK, "cuda", torch.bfloat16)
    kv.normal_()
    be = runner.backend
    # this diagnostic is of the CUDA-core kernel: eager and graphs both (DecodeGraphs reads the backend's choice)
    be.decode_tensor_cores = False
    be.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(be.workspace, kv_layout="NHD", use_tensor_cores=False)
    graphs = DecodeGraphs(runner.model, be, BLOCK, 16, 2048 // BLOCK, torch.device("cuda"))
    results = {}
    for lens in ([17], [17, 300, 1200, 64], [65, 130, 700, 33, 1500, 9]):
        seqs = _seqs(len(lens), max(lens), 1)
        for s, n in zip(seqs, lens):
            s.prompt_token_ids = s.prompt_token_ids[:n]
            s.sampling.prompt_token_ids = s.prompt_token_ids
            s.num_computed_tokens = n - 1
        batch = [ScheduledSeq(s, 1) for s in seqs]
        ids, pos, md = runner.build_metadata(batch)
        tables = [s.block_ids[:(n + BLOCK - 1) // BLOCK] for s, n in zip(seqs, md.seq_lens_list)]
        saved = kv.clone()
        be.begin_batch(md)
        eager = runner.model.forward(ids, pos, AttentionContext(be, md)).float()
        kv.copy_(saved)
        graph = graphs.run(0, ids, pos, md, tables).float()
        rel = float((graph - eager).norm() / eager.norm())
        same_argmax = bool((runner.model.compute_logits(graph.bfloat16()).argmax(-1)
                            == runner.model.compute_logits(eager.bfloat16()).argmax(-1)).all())
        results[str(lens)] = {"rel_diff": rel, "same_argmax": same_argmax, "graphs_captured": len(graphs.graphs)}
        print(lens, results[str(lens)])
    save("gpu_graph_check_h100", {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
