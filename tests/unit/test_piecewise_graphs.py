"""Piecewise graphs' cut of the forward (pieces between attentions over static buffers) equals the whole
forward on CPU, where the pieces run eagerly: prefill, chunked prefill over cached KV, mixed and decode
steps, padded rows holding a bigger step's values, for Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm).
The CUDA capture of the same pieces is checked on the GPU (tests/gpu/test_piecewise_gpu.py)."""

from __future__ import annotations

import json
from importlib.resources import files

import pytest
import torch

from bullet_ray.engine.piecewise_graphs import PiecewiseGraphs, choose_buckets, token_buckets, tune_buckets
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.llama import LlamaForCausalLM
from bullet_ray.models.testing import PagedRunner
from tests.hf_random import perturb_norms_and_biases

PROMPTS = [[1, 17, 300, 42, 9, 255, 77, 5, 88, 130, 64], [1, 400, 23], list(range(40, 60))]


def _model(preset: str, num_layers: int = 3) -> LlamaForCausalLM:
    d = json.loads((files("bullet_ray.models") / "presets" / f"{preset}.json").read_text())
    d["num_hidden_layers"] = num_layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(d))
    perturb_norms_and_biases(model)
    return model


class _Piecewise(torch.nn.Module):
    """Calls like the model, but runs the forward through PiecewiseGraphs' pieces (eagerly, on CPU)."""

    def __init__(self, model: LlamaForCausalLM, max_tokens: int) -> None:
        super().__init__()
        self.inner, self.config = model, model.config
        self.graphs = PiecewiseGraphs(model, max_tokens, "cpu", capture=False)
        self.ran: list[bool] = []

    def forward(self, ids, positions, ctx):
        hidden = self.graphs.run(0, ids, positions, ctx)
        self.ran.append(hidden is not None)
        return hidden if hidden is not None else self.inner.forward(ids, positions, ctx)

    def compute_logits(self, hidden, upcast=True):
        return self.inner.compute_logits(hidden, upcast)


# step time (ms, all layers' GEMMs) of Llama-3.1-8B's projections on the H100 at every 32 rows of 1,025-2,048
# (benchmarks/results/gemm_shapes_h100/gemm_shapes.json, step_ms)
H100_GEMM_MS = dict(zip(range(1056, 2049, 32), (
    20.79, 20.38, 21.09, 20.67, 22.51, 23.04, 22.44, 23.45, 24.82, 25.35, 27.26, 28.8, 28.03, 28.78, 27.8, 28.96,
    30.08, 33.21, 33.9, 34.27, 36.79, 37.11, 33.56, 34.61, 39.92, 36.54, 36.85, 38.69, 38.6, 38.29, 38.5, 38.44)))


def _mean_ms(buckets: list[int], low: int, high: int, ms: dict[int, float]) -> float:
    return sum(ms[next(b for b in buckets if b >= n)] for n in range(low + 1, high + 1)) / (high - low)


def test_choose_buckets_is_the_fastest_set_of_its_size():
    """Brute force over every 3-subset agrees with the dynamic programme; the top is always kept."""
    import itertools

    ms = {8: 5.0, 16: 9.0, 24: 8.0, 32: 16.0, 40: 15.0, 48: 30.0}
    chosen = choose_buckets(0, 48, 3, ms)
    best = min((sorted(c) + [48] for c in itertools.combinations([8, 16, 24, 32, 40], 2)),
               key=lambda b: _mean_ms(b, 0, 48, ms))
    assert chosen == best and chosen[-1] == 48
    assert _mean_ms(chosen, 0, 48, ms) <= _mean_ms([16, 32, 48], 0, 48, ms)
    assert choose_buckets(0, 48, 1, ms) == [48]
    # a size slower than a larger one is never worth a bucket: fewer buckets come back
    assert choose_buckets(0, 16, 2, {8: 9.0, 16: 8.0}) == [16]
    with pytest.raises(ValueError, match="top 48"):
        choose_buckets(0, 48, 2, {8: 1.0})


def test_tuned_buckets_on_the_h100_table_beat_the_fixed_ones():
    """Same count of buckets in (1024, 2048], chosen from the H100's times: 2.6% less GEMM time on average."""
    fixed = token_buckets(2048)
    calls: list[int] = []

    def time_ms(t: int) -> float:
        calls.append(t)
        return H100_GEMM_MS.get(t, t / 50)  # below 1,024 rows: smooth, as the doubling region is left alone

    tuned, times = tune_buckets(fixed, time_ms)
    assert len(tuned) == len(fixed) and tuned[-1] == 2048 and len(calls) == len(set(calls)) == len(times)
    assert [b for b in tuned if b <= 512] == [b for b in fixed if b <= 512]  # the small buckets stay
    high = [b for b in tuned if b > 1024]
    assert high == [1152, 1248, 1344, 1504, 1568, 1760, 1888, 2048]
    before, after = _mean_ms(fixed, 1024, 2048, H100_GEMM_MS), _mean_ms(tuned, 1024, 2048, H100_GEMM_MS)
    assert after < before and (before - after) / before == pytest.approx(0.026, abs=0.002)
    # every step at its own size (the table's 32-token rows: what running unpadded would take) is in between
    exact = _mean_ms(list(range(1056, 2049, 32)), 1024, 2048, H100_GEMM_MS)
    assert (round(before, 2), round(exact, 2), round(after, 2)) == (30.99, 30.42, 30.19)
    assert set(range(1056, 2049, 32)) <= set(calls) and max(calls) == 2048
    # a budget ending inside a range keeps it as the top; a tiny budget has nothing to tune
    tuned_1500, _ = tune_buckets(token_buckets(1500), time_ms)
    assert tuned_1500[-1] == 1500 and len(tuned_1500) == len(token_buckets(1500))
    assert tune_buckets(token_buckets(300), time_ms)[0] == token_buckets(300)


def test_budgets_past_4096_tune_their_ranges_at_coarser_candidates():
    """vLLM's 8,192-token budget times (4,096, 8,192] every 64 tokens and offline's 16,384 (8,192, 16,384] every 128,
    each range keeping at most the fixed ladder's count; a 2,048-token budget times nothing above 2,048."""
    calls: list[int] = []

    def time_ms(t: int) -> float:  # a tile-quantised GEMM: a step costs its rows rounded up to 384
        calls.append(t)
        return -(-t // 384) * 384 / 50

    for budget, step in ((8192, 64), (16384, 128)):
        calls.clear()
        fixed = token_buckets(budget)
        tuned, _ = tune_buckets(fixed, time_ms)
        low = budget // 2
        assert sorted(t for t in calls if t > low) == list(range(low + step, budget + 1, step))
        assert len([b for b in tuned if b > low]) <= len([b for b in fixed if b > low]) and tuned[-1] == budget
        ms = {t: time_ms(t) for t in set(tuned) | set(fixed)}
        assert _mean_ms(tuned, low, budget, ms) < _mean_ms(fixed, low, budget, ms)  # the tiles' multiples win
    calls.clear()
    tune_buckets(token_buckets(2048), time_ms)
    assert max(calls) == 2048


def test_bucket_choice_is_validated_and_tuning_needs_captured_graphs():
    from bullet_ray.config import EngineConfig
    from bullet_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="piecewise_buckets"):
        EngineConfig(model="dummy:tiny-llama", device="cpu", piecewise_buckets="Tuned")
    assert EngineConfig(model="dummy:tiny-llama", device="cpu").piecewise_buckets == "tuned"
    graphs = PiecewiseGraphs(_model("tiny-llama"), 2048, "cpu", capture=False)
    graphs.tune()  # nothing to time without CUDA graphs: the fixed buckets stay
    assert graphs.buckets == token_buckets(2048) and graphs.tuning is None


def test_token_buckets():
    assert token_buckets(2048) == [8, 16, 32, 64, 128, *range(160, 513, 32), *range(576, 1025, 64),
                                   *range(1152, 2049, 128)]
    assert token_buckets(640) == [8, 16, 32, 64, 128, *range(160, 513, 32), 576, 640]
    big = token_buckets(16384)  # larger budgets: every 128 to 4,096, every 256 to 8,192, every 512 beyond
    assert big[:len(token_buckets(2048))] == token_buckets(2048)
    assert [b for b in big if 2048 < b <= 8192] == [*range(2176, 4097, 128), *range(4352, 8193, 256)]
    assert big[-3:] == [15360, 15872, 16384] and 8704 in big and 8448 not in big
    assert all((b - a) / a <= 0.125 for a, b in zip(big, big[1:]) if a >= 512)
    assert all((b - a) / a <= 0.0625 for a, b in zip(big, big[1:]) if a >= 2048)  # pads by under 6.3% there
    assert len(token_buckets(8192)) == 65 and len(big) == 81
    assert token_buckets(100) == [8, 16, 32, 64, 100]
    assert token_buckets(300) == [8, 16, 32, 64, 128, 160, 192, 224, 256, 288, 300]
    assert token_buckets(8) == [8]
    assert token_buckets(0) == []


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_pieces_equal_the_whole_forward(preset):
    model = _model(preset)
    whole = PagedRunner(model, len(PROMPTS), 64, seed=1)
    pieces = _Piecewise(model, 40)
    cut = PagedRunner(pieces, len(PROMPTS), 64, seed=1)
    steps = (
        PROMPTS,  # a prefill of 34 tokens (bucket 40)
        [[7], [8], []],  # a decode step of 2 rows: rows 2..7 of bucket 8 hold the last step's values
        [p[:5] for p in PROMPTS],  # chunked prefill over the cached KV
        [[3], [4], list(range(100, 120))],  # mixed: decodes first, then a prompt chunk
        [list(range(200, 241)), [], []],  # 41 tokens: past the largest bucket, eager
    )
    for step in steps:
        torch.testing.assert_close(cut.step(step), whole.step(step), rtol=1e-5, atol=1e-5)
    assert pieces.ran == [True, True, True, True, False]


def test_padding_rows_never_reach_the_kv_pool():
    """A small step after a large one in the same bucket writes K/V for its own tokens only."""
    model = _model("tiny-llama")
    pieces = _Piecewise(model, 64)
    runner = PagedRunner(pieces, 2, 64, seed=1)
    runner.step([list(range(1, 30)), []])  # fills rows 0..28 of bucket 32
    before = runner.kv_cache.clone()
    runner.step([[], [5, 6]])  # 2 tokens: bucket 8, rows 2..7 stale
    changed = (runner.kv_cache != before).flatten(2).any(-1)  # [layer, block]
    blocks = runner.block_tables[1]
    assert changed[:, blocks[0]].all() and int(changed.sum()) == model.num_layers  # one block per layer


def test_backend_writes_into_a_given_output():
    """The pieces hand attention their static output buffer: a backend returns that buffer, filled with what
    it returns without one."""
    from bullet_ray.engine.attention.base import AttentionMetadata
    from bullet_ray.engine.attention.torch_ref import TorchAttentionBackend

    torch.manual_seed(0)
    kv = torch.zeros(1, 4, 2, 4, 2, 8)  # [layers, blocks, K/V, block_size, kv_heads, head_dim]
    backend = TorchAttentionBackend(kv, num_heads=4, num_kv_heads=2, head_dim=8, scale=8 ** -0.5)
    md = AttentionMetadata.contiguous([3, 2], [3, 2], block_size=4, device="cpu")
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    expected = backend.forward(0, q, k, v, md)
    out = torch.full((5, 4, 8), float("nan"))
    got = backend.forward(0, q, k, v, md, out=out)
    assert got is out
    torch.testing.assert_close(out, expected)
