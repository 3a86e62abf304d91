"""Layer-wise prefill on the GPU (dummy SmolLM2-135M shapes, bullet schedule, green contexts where present):
long prefill batches run in layer groups over one flashinfer plan while the slo policy may move the split
between groups, and the greedy tokens agree with the whole prefill (the same kernels; bf16 near-ties aside).

Run: python -m pytest tests/gpu/test_layerwise_gpu.py -q
"""

from __future__ import annotations

import pytest

from tests.gpu.logged_run import run_logged

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate([5, 600, 3000, 17, 1000, 3])]
MIN_TOKENS = 256


def _run(tmp_path, num_groups: int):
    tokens, records, _ = run_logged(tmp_path / f"steps-{num_groups}.jsonl", PROMPTS, 32, schedule="bullet",
                                    split_policy="slo", max_num_batched_tokens=2048, prefill_layer_groups=num_groups,
                                    prefill_layer_group_min_tokens=MIN_TOKENS)
    return tokens, [r for r in records if r["kind"] == "step" and r["side"] == "prefill"]


def test_layerwise_prefill_on_gpu_agrees_with_whole_prefill(tmp_path):
    whole, _ = _run(tmp_path, 1)
    grouped, prefill_steps = _run(tmp_path, 4)
    assert all(len(t) == 32 for t in grouped)
    assert [t[0] for t in grouped] == [t[0] for t in whole]
    same = sum(a == b for g, w in zip(grouped, whole) for a, b in zip(g, w))
    assert same / sum(len(w) for w in whole) >= 0.9
    long_steps = [r for r in prefill_steps if r["num_tokens"] >= MIN_TOKENS]
    assert long_steps and all(r["layer_groups"] == 4 for r in long_steps)
