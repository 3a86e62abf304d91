"""The bullet schedule's mixed fallback on the GPU (dummy SmolLM2-135M shapes, green contexts where present):
with `mixed_fallback_tokens: 1` the prefill worker hands every prompt that waits while decode runs to the
decode worker, which prefills it in chunks inside its steps (on the whole-GPU entry through piecewise graphs
captured at start, eagerly elsewhere); the greedy tokens agree with the chunked schedule's (the same kernels;
bf16 near-ties aside), no graph is captured while serving and every KV block comes back.

Run: python -m pytest tests/gpu/test_mixed_fallback_gpu.py -q
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in
           enumerate([5, 600, 3000, 17, 1000, 3, 250, 1800, 40, 700])]


def _run(tmp_path, schedule: str, **extra):
    """(greedy tokens, step-log records, the engine's stats after the run)."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    log = tmp_path / f"steps-{schedule}.jsonl"
    config = EngineConfig(model="dummy:smollm2-135m", device="cuda", schedule=schedule, kv_cache_memory_gb=1.0,
                          max_num_seqs=16, max_num_batched_tokens=1024, step_log_path=str(log), **extra)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLMEngine(config) as engine:
        tokens = [o.token_ids for o in engine.generate(PROMPTS, params)]
        stats = engine.stats()
        assert stats.num_free_kv_blocks == stats.num_kv_blocks
    return tokens, [json.loads(line) for line in log.read_text().splitlines()], stats


def test_mixed_fallback_on_gpu_agrees_with_chunked(tmp_path):
    chunked, _, _ = _run(tmp_path, "chunked")
    mixed, records, stats = _run(tmp_path, "bullet", split_policy="slo", mixed_fallback_tokens=1)
    assert all(len(t) == 32 for t in mixed)
    assert [t[0] for t in mixed] == [t[0] for t in chunked]
    same = sum(a == b for m, c in zip(mixed, chunked) for a, b in zip(m, c))
    assert same / sum(len(c) for c in chunked) >= 0.9
    steps = [r for r in records if r["kind"] == "step"]
    mixed_steps = [r for r in steps if r["side"] == "decode" and r["phase"] == "mixed"]
    # on the whole-GPU entry: every SM, through the piecewise graphs captured at start; prefill never steps there
    whole = [r for r in mixed_steps if r["prefill_sms"] == 0]
    assert whole and all(r["graphs"] == "piecewise" for r in whole)
    assert all(r["prefill_sms"] > 0 for r in steps if r["side"] == "prefill")
    assert stats.extra["num_graph_captures_serving"] == 0  # every graph it ran was captured at start
