"""Sampler: greedy, masks, distributions, seeds across batches and a process hop, penalties, logprobs."""

from __future__ import annotations

import math
import pickle
from collections import Counter

import pytest
import torch

from bullet_ray.engine.sampler import Sampler, SamplingState, is_stop_token
from bullet_ray.engine.sampling_params import SamplingParams


def _state(prompt: list[int] | None = None, output: list[int] | None = None, **kw) -> SamplingState:
    return SamplingState(SamplingParams(**kw), prompt if prompt is not None else [1, 2, 3], output)


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_of_the_raw_logits_with_ties_to_the_lowest_index():
    logits = _logits(6, 50, 0)
    logits[0, 7] = logits[0, 31] = 100.0
    out = Sampler().sample(logits, [_state(temperature=0.0) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.token_ids[0] == 7


def test_plain_greedy_takes_the_argmax_in_the_logits_own_dtype():
    """A batch of plain greedy rows (no logprobs, no penalties) is sampled without a float32 copy of its logits,
    and picks the same tokens as over that copy, ties to the lowest index; a batch with any other row (sampled,
    penalised, logprobs) upcasts as before and still decides its greedy rows by the argmax."""
    logits = (_logits(8, 300, 5) * 4).to(torch.bfloat16)  # bf16 rounding makes ties common
    logits[2, 10] = logits[2, 250] = 50.0
    greedy = Sampler().sample_on_device(logits, [_state(temperature=0.0) for _ in range(8)])
    assert greedy.token_ids.dtype == torch.int64
    assert greedy.token_ids.tolist() == logits.float().argmax(-1).tolist() and greedy.token_ids[2] == 10
    mixed = [_state(temperature=0.0) for _ in range(7)] + [_state(temperature=0.0, logprobs=2)]
    out = Sampler().sample(logits, mixed)
    assert out.token_ids == greedy.token_ids.tolist()
    assert out.logprobs[7] is not None and out.logprobs[0] is None
    assert math.isclose(out.logprobs[7].logprob, float(torch.log_softmax(logits[7].float(), -1).max()), abs_tol=1e-5)


@pytest.mark.parametrize("kw", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}, {"temperature": 1e-7}])
def test_degenerate_masks_reduce_to_greedy(kw):
    logits = _logits(8, 50, 1)
    seeded = [_state(seed=i, **{"temperature": 1.5, **kw}) for i in range(4)]
    unseeded = [_state(**{"temperature": 1.5, **kw}) for _ in range(4)]
    for _ in range(5):
        assert Sampler().sample(logits, seeded + unseeded).token_ids == logits.argmax(-1).tolist()


def _draw_counts(logits_row: torch.Tensor, num_draws: int, **kw) -> Counter:
    """One row per draw, each with its own seed: one vectorized call."""
    states = [_state(seed=1000 + i, **kw) for i in range(num_draws)]
    return Counter(Sampler().sample(logits_row.expand(num_draws, -1).clone(), states).token_ids)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


@pytest.mark.parametrize("kw,expected", [
    ({}, [0.5, 0.3, 0.15, 0.05]),
    ({"temperature": 2.0}, (PROBS.sqrt() / PROBS.sqrt().sum()).tolist()),
    ({"top_k": 2}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
    ({"top_p": 0.7}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # 0.5 < 0.7 -> add 0.3; 0.8 >= 0.7 -> stop
    ({"top_p": 0.85}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
    ({"min_p": 0.35}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),  # threshold 0.175
    ({"top_k": 3, "top_p": 0.7, "min_p": 0.0}, [0.5 / 0.8, 0.3 / 0.8, 0, 0]),
])
def test_sampled_frequencies_follow_the_processed_distribution(kw, expected):
    num_draws = 4000
    counts = _draw_counts(LOGITS, num_draws, **{"temperature": 1.0, **kw})
    for token, p in enumerate(expected):
        if p == 0:
            assert counts[token] == 0, (token, counts)
        else:
            assert abs(counts[token] / num_draws - p) < 0.03, (token, counts)


def test_masks_work_in_a_shuffled_vocabulary_and_keep_the_right_tokens():
    logits = _logits(1, 200, 2)[0]
    best5 = set(logits.topk(5).indices.tolist())
    counts = _draw_counts(logits, 600, temperature=3.0, top_k=5)
    assert set(counts) <= best5 and len(counts) == 5
    probs = torch.softmax(logits, -1)
    counts = _draw_counts(logits, 600, temperature=1.0, min_p=0.2)
    assert set(counts) == set((probs >= 0.2 * probs.max()).nonzero().flatten().tolist())


def _mixed_batch_run(target: SamplingState, logits: torch.Tensor, hop_at: int | None, position: int) -> list[int]:
    """Sample `target` for every step of `logits` ([steps, vocab]) inside a batch of other requests."""
    sampler = Sampler()
    others = [_state(seed=43, temperature=0.8), _state(temperature=0.0), _state(temperature=1.2, top_p=0.5),
              _state(top_k=3, presence_penalty=1.0)]
    tokens = []
    for step in range(logits.shape[0]):
        if step == hop_at:  # the request moves from the prefill process to the decode process
            target = SamplingState.from_wire(pickle.loads(pickle.dumps(target.to_wire())))
        batch = others[:step % (len(others) + 1)]
        pos = min(position, len(batch))
        batch = batch[:pos] + [target] + batch[pos:]
        rows = torch.stack([_logits(1, logits.shape[1], 100 + step + 7 * j)[0] for j in range(len(batch))])
        rows[pos] = logits[step]
        out = sampler.sample(rows, batch)
        for s, t in zip(batch, out.token_ids):
            s.append(t)
        tokens.append(out.token_ids[pos])
    return tokens


@pytest.mark.parametrize("kw", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 10, "top_p": 0.9, "min_p": 0.02},
                                {"temperature": 1.3, "repetition_penalty": 1.3, "frequency_penalty": 0.5}])
def test_seeded_stream_is_the_same_alone_in_any_batch_and_after_a_process_hop(kw):
    logits = _logits(20, 64, 3)
    alone = _state(seed=42, **kw)
    sampler = Sampler()
    reference = []
    for step in range(20):
        token = sampler.sample(logits[step:step + 1], [alone]).token_ids[0]
        alone.append(token)
        reference.append(token)
    assert len(set(reference)) > 3  # really random
    assert _mixed_batch_run(_state(seed=42, **kw), logits, None, 0) == reference
    assert _mixed_batch_run(_state(seed=42, **kw), logits, 10, 2) == reference
    assert _mixed_batch_run(_state(seed=43, **kw), logits, None, 1) != reference
    assert _mixed_batch_run(_state(**kw), logits, None, 1) != _mixed_batch_run(_state(**kw), logits, None, 1)


def test_the_wire_form_is_plain_picklable_data_and_keeps_the_token_history():
    state = _state(seed=5, output=[4, 5])
    wire = state.to_wire()
    assert isinstance(wire["rng_state"], bytes)
    copy = SamplingState.from_wire(pickle.loads(pickle.dumps(wire)))
    assert (copy.params, copy.prompt_token_ids, copy.output_token_ids) == (state.params, [1, 2, 3], [4, 5])
    assert [copy.next_uniform() for _ in range(3)] == [state.next_uniform() for _ in range(3)]


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0], [2.0, -1.0, 0.5, 0.0, 3.0]])
    rep = _state([0, 1], [2, 2], temperature=0.0, repetition_penalty=2.0)
    out = Sampler._apply_penalties(logits, [rep, _state(temperature=0.0)])
    assert out.tolist() == [[1.0, -2.0, 0.25, 0.0, 3.0], [2.0, -1.0, 0.5, 0.0, 3.0]]
    assert logits[0, 0] == 2.0  # the input is not modified
    openai = _state([0], [2, 2, 3], temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = Sampler._apply_penalties(logits[:1], [openai])  # prompt token 0 is not penalized
    assert out.tolist() == [[2.0, -1.0, 0.5 - 0.5 - 0.5, 0.0 - 0.25 - 0.5, 3.0]]
    both = _state([4], [4, 1], temperature=0.0, repetition_penalty=1.5, presence_penalty=-1.0)
    out = Sampler._apply_penalties(logits[:1], [both])
    assert out[0].tolist() == pytest.approx([2.0, -1.5 + 1.0, 0.5, 0.0, 2.0 + 1.0])


def test_logit_bias_adds_to_the_listed_logits_first_and_steers_greedy_and_sampling():
    """The bias is added before the penalties (repetition divides a positive biased logit), per row; greedy follows
    it; -100 bans a token from sampling; logprobs stay the raw model's."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0], [2.0, -1.0, 0.5, 0.0, 3.0]])
    # token 2 is in the history and biased: (0.5 + 1.0) / 2 = 0.75 (penalty first would give 0.25 + 1.0 = 1.25)
    biased = _state([2], temperature=0.0, logit_bias={"1": 4.0, "2": 1.0, "4": -1.0}, repetition_penalty=2.0)
    out = Sampler._apply_penalties(logits, [biased, _state(temperature=0.0)])
    assert out.tolist() == [[2.0, 3.0, 0.75, 0.0, 2.0], [2.0, -1.0, 0.5, 0.0, 3.0]]
    assert logits[0, 1] == -1.0  # the input is not modified
    sampler = Sampler()
    assert sampler.sample(logits, [_state(temperature=0.0, logit_bias={"3": 5.0}), _state(temperature=0.0)]
                          ).token_ids == [3, 4]
    banned = _state(temperature=1.0, seed=3, logit_bias={"4": -100.0, "0": -100.0}, logprobs=1)
    draws = [sampler.sample(_logits(1, 5, 9), [banned]) for _ in range(200)]
    assert {d.token_ids[0] for d in draws} <= {1, 2, 3}
    ref = torch.log_softmax(_logits(1, 5, 9), -1)[0]
    assert draws[0].logprobs[0].logprob == pytest.approx(float(ref[draws[0].token_ids[0]]))


def test_greedy_with_penalties_is_argmax_of_the_penalized_logits():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    assert Sampler().sample(logits, [_state([0], temperature=0.0, repetition_penalty=2.0)]).token_ids == [1]
    assert Sampler().sample(logits, [_state([], [0], temperature=0.0, frequency_penalty=0.5)]).token_ids == [0]
    assert Sampler().sample(logits, [_state([], [0] * 3, temperature=0.0, frequency_penalty=0.5)]).token_ids == [1]


def test_logprobs_are_the_raw_log_softmax_with_sorted_top_n():
    logits = _logits(3, 30, 4)
    states = [_state(temperature=0.9, top_k=5, repetition_penalty=1.5, seed=1, logprobs=4),
              _state(temperature=0.0), _state(temperature=0.0, logprobs=0)]
    out = Sampler().sample(logits, states)
    ref = torch.log_softmax(logits, -1)
    lp = out.logprobs[0]
    assert lp.token_id == out.token_ids[0]
    assert lp.logprob == pytest.approx(float(ref[0, out.token_ids[0]]))
    assert [t for t, _ in lp.top] == ref[0].topk(4).indices.tolist()
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True) and values == pytest.approx(ref[0].topk(4).values.tolist())
    assert out.logprobs[1] is None
    assert out.logprobs[2].top == () and out.logprobs[2].logprob == pytest.approx(float(ref[2].max()))
    assert math.isclose(sum(math.exp(v) for v in ref[0].tolist()), 1.0, rel_tol=1e-5)


def test_stop_tokens_honor_stop_token_ids_eos_and_ignore_eos():
    eos = (2, 7)
    assert is_stop_token(2, eos, SamplingParams())
    assert not is_stop_token(3, eos, SamplingParams())
    assert is_stop_token(3, eos, SamplingParams(stop_token_ids=[3]))
    assert not is_stop_token(7, eos, SamplingParams(ignore_eos=True))
    assert is_stop_token(3, eos, SamplingParams(ignore_eos=True, stop_token_ids=[3]))
    assert _state(stop_token_ids=[9]).is_stop_token(9, ())


def test_append_grows_the_output_and_shapes_are_checked():
    state = _state()
    state.append(11)
    assert state.output_token_ids == [11]
    with pytest.raises(ValueError, match="logits"):
        Sampler().sample(torch.zeros(2, 5), [state])


def test_masks_are_value_thresholds_so_ties_at_the_cut_are_all_kept():
    logits = torch.tensor([3.0, 2.0, 2.0, 1.0, 2.0])
    assert set(_draw_counts(logits, 300, temperature=1.0, top_k=2)) == {0, 1, 2, 4}
    probs = torch.tensor([0.4, 0.2, 0.2, 0.2])  # 0.4 < 0.5 -> one more 0.2 reaches it: every 0.2 is tied
    assert set(_draw_counts(probs.log(), 300, temperature=1.0, top_p=0.5)) == {0, 1, 2, 3}
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    assert set(_draw_counts(probs.log(), 300, temperature=1.0, min_p=0.25)) == {0, 1, 2, 3}
    assert set(_draw_counts(probs.log(), 300, temperature=1.0, min_p=0.3)) == {0, 1}


def test_a_states_plain_greedy_flag_is_decided_once_from_its_frozen_parameters_and_survives_a_hop():
    """`SamplingState.plain_greedy` (read per row every step) is what the parameters say: greedy without logprobs,
    penalties or a logit bias; a wire copy decides it again alike, and so do parameters set anew; a batch with one row that is not plain greedy
    goes through the full sampler (its bias decides that row's token)."""
    cases = {"plain": (dict(temperature=0.0), True), "random": (dict(temperature=0.7), False),
             "logprobs": (dict(temperature=0.0, logprobs=2), False),
             "penalty": (dict(temperature=0.0, repetition_penalty=1.2), False),
             "bias": (dict(temperature=0.0, logit_bias={"3": 50.0}), False)}
    for name, (kw, plain) in cases.items():
        state = _state(**kw)
        assert state.plain_greedy is plain, name
        assert SamplingState.from_wire(pickle.loads(pickle.dumps(state.to_wire()))).plain_greedy is plain, name
    state = _state(temperature=0.0)
    state.params = SamplingParams(temperature=0.0, logprobs=1)  # new parameters: decided again
    assert not state.plain_greedy
    logits = _logits(3, 20, 5)  # |logits| well under the bias
    out = Sampler().sample(logits, [_state(temperature=0.0), _state(temperature=0.0, logit_bias={"3": 100.0}),
                                    _state(temperature=0.0)])
    assert out.token_ids == [int(logits[0].argmax()), 3, int(logits[2].argmax())]
