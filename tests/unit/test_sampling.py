"""SamplingParams validation and the sampler: greedy, masks, seeds across a process hop, penalties, logprobs."""

from __future__ import annotations

import pickle

import pytest
import torch

from bullet_ray.engine.sampler import Sampler, SamplingState
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidSamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("top_k", 0.5), ("min_p", 1.2), ("max_tokens", 0), ("max_tokens", 2.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("logprobs", 21), ("logprobs", -1), ("seed", -1),
    ("stop", [""]), ("stop", ["x"] * 17), ("stop_token_ids", [-5]),
])
def test_each_bad_parameter_names_its_field(field, value):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


def test_openai_body_maps_to_params():
    p = SamplingParams.from_openai({"max_completion_tokens": 7, "stop": "END", "temperature": 0, "seed": 3,
                                    "logprobs": True, "top_logprobs": 2, "top_k": 5, "ignore_eos": True})
    assert (p.max_tokens, p.stop, p.temperature, p.seed, p.logprobs, p.top_k, p.ignore_eos) == \
        (7, ("END",), 0, 3, 2, 5, True)
    assert SamplingParams.from_openai({}).max_tokens == 16


def _state(**kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), [1, 2, 3])


def test_greedy_is_argmax_and_masks_reduce_to_greedy():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    sampler = Sampler()
    argmax = logits.argmax(-1).tolist()
    assert sampler.sample(logits, [_state(temperature=0.0) for _ in range(6)]).token_ids == argmax
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        states = [_state(temperature=1.0, seed=i, **kw) for i in range(6)]
        assert sampler.sample(logits, states).token_ids == argmax, kw


def test_top_k_only_draws_from_the_k_best():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(1))
    best3 = set(logits[0].topk(3).indices.tolist())
    state = _state(temperature=2.0, top_k=3, seed=5)
    draws = {Sampler().sample(logits, [state]).token_ids[0] for _ in range(200)}
    assert draws <= best3 and len(draws) == 3


def test_seeded_stream_is_the_same_alone_in_a_batch_and_after_a_process_hop():
    logits = torch.randn(20, 3, 64, generator=torch.Generator().manual_seed(2))
    sampler = Sampler()
    alone = _state(temperature=1.0, seed=42)
    batched = _state(temperature=1.0, seed=42)
    other = _state(temperature=1.0, seed=43)
    a, b = [], []
    for step in range(20):
        a += sampler.sample(logits[step, :1], [alone]).token_ids
        out = sampler.sample(logits[step, :2].flip(0), [other, batched]).token_ids  # rows: 1, 0
        b.append(out[1])
        if step == 10:  # the request moves from the prefill process to the decode process
            batched = SamplingState.from_wire(pickle.loads(pickle.dumps(batched.to_wire())))
    assert a == b
    seed43 = _state(temperature=1.0, seed=43)
    assert a != [sampler.sample(logits[s, :1], [seed43]).token_ids[0] for s in range(20)]


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    state = SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), [0, 1], [2, 2])
    out = Sampler._apply_penalties(logits, [state])
    assert out.tolist() == [[1.0, -2.0, 0.25, 0.0]]
    state = SamplingState(SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25), [0], [2, 2, 3])
    out = Sampler._apply_penalties(logits, [state])
    assert out.tolist() == [[2.0, -1.0, 0.5 - 0.5 - 0.5, 0.0 - 0.25 - 0.5]]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    out = Sampler().sample(logits, [_state(temperature=0.0, logprobs=3), _state(temperature=0.0)])
    ref = torch.log_softmax(logits[0], -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(float(ref.max()))
    assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
    assert out.logprobs[1] is None
