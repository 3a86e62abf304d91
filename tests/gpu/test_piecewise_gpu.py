"""Piecewise CUDA graphs on the GPU (a 4-layer Llama with Llama-3.1-8B's head shapes, dummy weights: the
flashinfer kernels of the served model, already in the JIT cache): a mixed step through the captured pieces
equals the eager forward (same flashinfer plan); the chunked schedule and the bullet prefill side capture
every piece at start and none while serving, free every KV block, and agree with the eager engine token
for token but for bf16 near-ties (a padded bucket is a different GEMM shape)."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 30000 + 100 for j in range(n)] for i, n in enumerate([5, 60, 300, 17, 1000, 3])]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
          "head_dim": 128, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 4096,
          "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def model_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return f"dummy:{path}"


def _model_and_backend(model_source: str, num_blocks: int):
    from bullet_ray.engine.attention.base import get_backend_class
    from bullet_ray.models.loader import load_model

    model = load_model(model_source, torch.bfloat16, "cuda").model
    c = model.config
    kv = torch.zeros(c.num_hidden_layers, num_blocks, 2, 16, c.num_key_value_heads, c.head_dim, device="cuda",
                     dtype=torch.bfloat16)
    backend = get_backend_class("flashinfer")(kv, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                              c.head_dim ** -0.5, mixed_attention="split")  # whatever the env says
    return model, backend


def _cut_against_eager(graphs, model, backend, query_lens: list[int], seq_lens: list[int]) -> float:
    """Relative difference of one step (decodes first, then prompt chunks) through the pieces and eagerly."""
    from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata

    md = AttentionMetadata.contiguous(query_lens, seq_lens, 16, "cuda")
    n = sum(query_lens)
    ids = torch.randint(100, 30000, (n,), device="cuda")
    pos = torch.cat([torch.arange(s - q, s, device="cuda") for q, s in zip(query_lens, seq_lens)])
    with torch.inference_mode():
        backend.begin_batch(md)
        eager = model.forward(ids, pos, AttentionContext(backend, md)).float()
        backend.begin_batch(md)
        cut = graphs.run(0, ids, pos, AttentionContext(backend, md)).float()
    return float((cut - eager).norm() / eager.norm())


def test_captured_pieces_equal_the_eager_forward(model_source):
    from bullet_ray.engine.piecewise_graphs import PiecewiseGraphs

    model, backend = _model_and_backend(model_source, 64)
    graphs = PiecewiseGraphs(model, 256, "cuda")
    graphs.capture_all(0)
    rel = _cut_against_eager(graphs, model, backend, [1, 1, 37, 60], [20, 33, 37, 90])
    assert rel < 2e-2, f"relative difference {rel:.4f}"
    assert graphs.capture_report()["num_graphs"] == len(graphs.buckets) * (model.config.num_hidden_layers + 1)


def test_tuned_buckets_time_the_device_and_keep_the_pieces_exact(model_source):
    """`tune` re-chooses the buckets above 512 tokens from this GPU's times (at most as many as the fixed ones);
    a step on a tuned bucket still equals the eager forward."""
    from bullet_ray.engine.piecewise_graphs import PiecewiseGraphs, token_buckets

    model, backend = _model_and_backend(model_source, 256)
    graphs = PiecewiseGraphs(model, 1280, "cuda")
    graphs.tune()
    report = graphs.tuning
    assert report is not None and report["fixed"] == token_buckets(1280)
    # at most as many buckets (fewer where fewer are as fast)
    assert len(graphs.buckets) <= len(token_buckets(1280)) and graphs.buckets[-1] == 1280
    assert [b for b in graphs.buckets if b <= 512] == [b for b in token_buckets(1280) if b <= 512]
    assert set(range(544, 1280, 32)) <= set(report["piece_ms"]) and all(v > 0 for v in report["piece_ms"].values())
    graphs.capture_all(0)
    rel = _cut_against_eager(graphs, model, backend, [1, 1, 1100], [20, 33, 1100])
    assert rel < 2e-2, f"relative difference {rel:.4f}"
    assert "tuning" in graphs.capture_report()


def test_engine_tunes_its_buckets_and_agrees_with_fixed(model_source):
    """The chunked schedule with a 1,280-token budget: tuned buckets (the default) captured at start, none while
    serving, tokens as with the fixed buckets but for bf16 near-ties."""
    tokens, captures, piecewise = _run(model_source, "chunked", budget=1280)
    fixed, _, fixed_pw = _run(model_source, "chunked", budget=1280, piecewise_buckets="fixed")
    assert captures == 0 and "tuning" in piecewise and "tuning" not in fixed_pw
    assert len(piecewise["buckets"]) <= len(fixed_pw["buckets"])
    same = sum(a == b for g, e in zip(tokens, fixed) for a, b in zip(g, e))
    assert same / sum(len(e) for e in fixed) >= 0.9


def _run(model: str, schedule: str, budget: int = 512, mixed_attention: str = "split", **kw):
    """Greedy tokens of PROMPTS, graph captures while serving and the piecewise report; the workers' mixed-attention
    mode is `mixed_attention` whatever the environment says (they inherit BULLET_RAY_MIXED_ATTENTION)."""
    from bullet_ray.config import EngineConfig
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    config = EngineConfig(model=model, device="cuda", schedule=schedule, kv_cache_memory_gb=1.0,
                          max_num_seqs=16, max_num_batched_tokens=budget, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    role = "hybrid" if schedule == "chunked" else "prefill"
    before = os.environ.get("BULLET_RAY_MIXED_ATTENTION")
    os.environ["BULLET_RAY_MIXED_ATTENTION"] = mixed_attention
    try:
        with LLMEngine(config) as engine:
            tokens = [o.token_ids for o in engine.generate(PROMPTS, params)]
            stats = engine.stats()
            graphs = engine.worker_info[role].get("graphs") or {}
            assert stats.num_free_kv_blocks == stats.num_kv_blocks
            assert engine.worker_info[role]["mixed_attention"] == mixed_attention
    finally:
        if before is None:
            del os.environ["BULLET_RAY_MIXED_ATTENTION"]
        else:
            os.environ["BULLET_RAY_MIXED_ATTENTION"] = before
    return tokens, stats.extra["num_graph_captures_serving"], graphs.get("piecewise")


@pytest.mark.parametrize("schedule", ["chunked", "static"])
def test_piecewise_engine_agrees_with_eager(model_source, schedule):
    tokens, captures, piecewise = _run(model_source, schedule)
    eager, _, none = _run(model_source, schedule, piecewise_graph_tokens=0)
    assert none is None
    assert piecewise is not None and piecewise["num_graphs"] > 0 and captures == 0
    assert all(len(t) == 40 for t in tokens)
    same = sum(a == b for g, e in zip(tokens, eager) for a, b in zip(g, e))
    assert same / sum(len(e) for e in eager) >= 0.9


def test_holistic_mixed_attention_through_the_pieces_equals_the_split_kernels(model_source):
    """One mixed step of the 4-layer model through the captured pieces, its attention in one persistent kernel
    ("holistic", q read from the fused qkv rows, written into the pieces' static buffer) against the same step with
    the split kernels, eagerly: the final hidden states agree up to bf16 rounding."""
    from bullet_ray.engine.attention.base import AttentionContext, AttentionMetadata, get_backend_class
    from bullet_ray.engine.piecewise_graphs import PiecewiseGraphs

    model, split = _model_and_backend(model_source, 256)  # 4,096 slots: the step's rows hold 2,602 tokens
    c = model.config
    holistic = get_backend_class("flashinfer")(split.kv_cache.clone(), c.num_attention_heads, c.num_key_value_heads,
                                               c.head_dim, c.head_dim ** -0.5, mixed_attention="holistic")
    graphs = PiecewiseGraphs(model, 512, "cuda")
    graphs.capture_all(0)
    query_lens, seq_lens = [1] * 12 + [300, 45], [40 + 17 * i for i in range(12)] + [300, 700]
    md = AttentionMetadata.contiguous(query_lens, seq_lens, 16, "cuda")
    ids = torch.randint(100, 30000, (sum(query_lens),), device="cuda")
    pos = torch.cat([torch.arange(s - q, s, device="cuda") for q, s in zip(query_lens, seq_lens)])
    with torch.inference_mode():
        split.begin_batch(md)
        expected = model.forward(ids, pos, AttentionContext(split, md)).float()
        holistic.begin_batch(md)
        assert holistic._holistic_planned
        got = graphs.run(0, ids, pos, AttentionContext(holistic, md)).float()
    rel = float((got - expected).norm() / expected.norm())
    assert rel < 2e-2, f"relative difference {rel:.4f}"


def test_holistic_mixed_attention_serves_the_chunked_schedule(model_source):
    """BULLET_RAY_MIXED_ATTENTION=holistic reaches the chunked schedule's worker: every request gets its tokens, no
    capture while serving, every KV block freed. Token agreement with the split kernels is reported, not asserted:
    on the H100 (2026-11-27) 186 of 240 greedy tokens agreed, below the 90% that piecewise graphs keep against eager
    (a 4-layer random-weight model has many near-ties, and every prompt row of a mixed step runs another kernel, so
    a sequence leaves the split run's tokens at its first near-tie); the step above checks the numbers. (Not
    asserted either: async = sync tokens. Requests reach the worker one by one, so two runs may batch differently,
    and in this mode a row's rounding depends on its batch: the planner sizes KV splits from the whole batch.)"""
    split, _, _ = _run(model_source, "chunked")
    holistic, captures, piecewise = _run(model_source, "chunked", mixed_attention="holistic")
    assert captures == 0 and piecewise is not None and piecewise["num_graphs"] > 0
    assert all(len(t) == 40 for t in holistic)
    first_divergence = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), len(e)) for g, e in zip(holistic, split)]
    print(f"holistic vs split: first differing token per request {first_divergence}")
