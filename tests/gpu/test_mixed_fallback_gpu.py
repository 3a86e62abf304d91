"""The bullet schedule's mixed fallback on the GPU (dummy SmolLM2-135M shapes, green contexts where present):
with `mixed_fallback_tokens: 1` the prefill worker hands every prompt that waits while decode runs to the
decode worker, which prefills it in chunks inside its steps (on the whole-GPU entry through piecewise graphs
captured at start, eagerly elsewhere); the greedy tokens agree with the chunked schedule's (the same kernels;
bf16 near-ties aside), no graph is captured while serving and every KV block comes back.

Run: python -m pytest tests/gpu/test_mixed_fallback_gpu.py -q
"""

from __future__ import annotations

import pytest

from tests.gpu.logged_run import run_logged

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in
           enumerate([5, 600, 3000, 17, 1000, 3, 250, 1800, 40, 700])]


def _run(tmp_path, schedule: str, **extra):
    """(greedy tokens, step-log records, the engine's stats after the run)."""
    return run_logged(tmp_path / f"steps-{schedule}.jsonl", PROMPTS, 32, schedule=schedule,
                      max_num_batched_tokens=1024, **extra)


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
