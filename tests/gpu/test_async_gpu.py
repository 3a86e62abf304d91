"""The engine on the GPU with asynchronous scheduling and start-up CUDA graphs (dummy SmolLM2-135M shapes).

The chunked schedule gives the same greedy tokens with asynchronous scheduling on and off (the same
kernels run; only the host's order changes), captures every decode graph at start and none while
serving, and its graph decode agrees with eager decode (`enforce_eager`) token for token but for bf16
near-ties.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 60, 300, 17, 1000, 3])]


def _run(**kw):
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    config = EngineConfig(model="dummy:smollm2-135m", device="cuda", schedule="chunked", kv_cache_memory_gb=1.0,
                          max_num_seqs=16, max_num_batched_tokens=256, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLMEngine(config) as engine:
        tokens = [o.token_ids for o in engine.generate(PROMPTS, params)]
        stats = engine.stats()
        graphs = engine.worker_info["hybrid"].get("graphs")
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    return tokens, stats.extra["num_graph_captures_serving"], graphs


def test_async_equals_sync_and_no_graph_captured_while_serving():
    async_tokens, captures, graphs = _run(async_scheduling=True)
    sync_tokens, _, _ = _run(async_scheduling=False)
    assert async_tokens == sync_tokens
    assert all(len(t) == 40 for t in async_tokens)
    assert graphs is not None and graphs["num_graphs"] == len(graphs["buckets"]) and graphs["capture_s"] > 0
    assert captures == 0


def test_graph_decode_agrees_with_eager():
    graph_tokens, _, _ = _run(async_scheduling=True)
    eager_tokens, _, graphs = _run(async_scheduling=True, enforce_eager=True)
    assert graphs is None
    same = sum(a == b for g, e in zip(graph_tokens, eager_tokens) for a, b in zip(g, e))
    assert same / sum(len(e) for e in eager_tokens) >= 0.9
