"""SamplingParams: every bad value names its field; normalization; the OpenAI body mapping."""

from __future__ import annotations

import pytest

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidSamplingParams

BAD_VALUES = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 0.5), ("top_k", True),
    ("min_p", -0.1), ("min_p", 1.2),
    ("max_tokens", 0), ("max_tokens", 2.5), ("max_tokens", None),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", 1.0),
    ("seed", -1), ("seed", 2**63), ("seed", 1.5),
    ("stop", [""]), ("stop", ["x"] * 17), ("stop", [1]), ("stop", 5),
    ("stop_token_ids", [-5]), ("stop_token_ids", ["3"]), ("stop_token_ids", 7),
    ("ignore_eos", "yes"), ("skip_special_tokens", 1),
    ("logit_bias", {"5": 101}), ("logit_bias", {"5": float("nan")}), ("logit_bias", {"x": 1}), ("logit_bias", {-1: 1}),
    ("logit_bias", {"5": "1"}), ("logit_bias", [1, 2]), ("logit_bias", "5"), ("logit_bias", {"1": 1, "01": 2}),
    ("logit_bias", {str(i): 1.0 for i in range(1025)}), ("logit_bias", {"9" * 5000: 1}), ("logit_bias", {"²": 1}),
    ("logit_bias", {"": 1}), ("logit_bias", {" 5": 1}),
]


@pytest.mark.parametrize("field,value", BAD_VALUES)
def test_each_bad_parameter_names_its_field_and_value(field, value):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize("field,value,shown", [("temperature", -0.1, "-0.1"), ("top_p", 1.5, "(0, 1]"),
                                               ("logprobs", 21, "[0, 20]"), ("stop", ["x"] * 17, "16")])
def test_messages_show_the_value_or_the_allowed_range(field, value, shown):
    with pytest.raises(InvalidSamplingParams, match=shown.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**{field: value})


def test_boundaries_are_accepted():
    p = SamplingParams(temperature=0, top_p=1, top_k=0, min_p=1, max_tokens=1, presence_penalty=-2,
                       frequency_penalty=2, repetition_penalty=1e-3, logprobs=20, seed=2**63 - 1,
                       stop=["s"] * 16, stop_token_ids=[0])
    assert p.is_greedy and p.top_k == -1 and p.logprobs == 20
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_stop_and_stop_token_ids_are_normalized_to_tuples():
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(stop=None).stop == ()
    assert hash(SamplingParams(stop=["a"])) == hash(SamplingParams(stop=("a",)))


def test_completions_body_maps_to_params():
    p = SamplingParams.from_openai({"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": ["x", "y"],
                                    "seed": 7, "logprobs": 3, "presence_penalty": 0.1, "frequency_penalty": -0.2,
                                    "top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True,
                                    "stop_token_ids": [9], "skip_special_tokens": False})
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.logprobs) == (5, 0.5, 0.9, ("x", "y"), 7, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.top_k, p.min_p, p.repetition_penalty) == \
        (0.1, -0.2, 40, 0.05, 1.1)
    assert (p.ignore_eos, p.stop_token_ids, p.skip_special_tokens) == (True, (9,), False)


def test_chat_body_maps_to_params():
    p = SamplingParams.from_openai({"max_completion_tokens": 7, "max_tokens": 99, "stop": "END", "temperature": 0,
                                    "logprobs": True, "top_logprobs": 2})
    assert (p.max_tokens, p.stop, p.temperature, p.logprobs) == (7, ("END",), 0.0, 2)
    assert SamplingParams.from_openai({"logprobs": True}).logprobs == 0
    assert SamplingParams.from_openai({"logprobs": False}).logprobs is None


def test_absent_or_null_fields_take_openai_defaults():
    p = SamplingParams.from_openai({"temperature": None, "top_p": None, "stop": None, "seed": None})
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed, p.logprobs) == (16, 1.0, 1.0, (), None, None)
    assert SamplingParams.from_openai({}, default_max_tokens=64).max_tokens == 64
    # the server's default may shrink to the context a long prompt leaves; a requested limit never does
    assert SamplingParams.from_openai({}).max_tokens_is_default
    assert not SamplingParams.from_openai({"max_tokens": 16}).max_tokens_is_default
    assert not SamplingParams.from_openai({"max_completion_tokens": 8}).max_tokens_is_default
    assert not SamplingParams(max_tokens=16).max_tokens_is_default


@pytest.mark.parametrize("body,field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"logprobs": 30}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 3, "logprobs": False}, "top_logprobs"),
    ({"stop": [""]}, "stop"), ({"top_k": -5}, "top_k"),
])
def test_bad_openai_fields_raise_with_openai_names(body, field):
    with pytest.raises(InvalidSamplingParams) as err:
        SamplingParams.from_openai(body)
    assert err.value.field == field


def test_logit_bias_is_normalized_to_sorted_id_bias_pairs_and_counts_as_modifying_logits():
    """JSON keys are strings: {"50256": -100} -> ((50256, -100.0),); pairs and int keys work too."""
    p = SamplingParams.from_openai({"logit_bias": {"7": 5, "3": -100}})
    assert p.logit_bias == ((3, -100.0), (7, 5.0)) and p.modifies_logits and not p.has_penalties
    assert SamplingParams(logit_bias=[(2, 1.5)]).logit_bias == ((2, 1.5),)
    assert SamplingParams(logit_bias={100: 100}).logit_bias == ((100, 100.0),)
    assert SamplingParams(logit_bias={}).logit_bias == () and not SamplingParams().modifies_logits
    with pytest.raises(InvalidSamplingParams, match=r"biases must be numbers in \[-100, 100\]") as err:
        SamplingParams.from_openai({"logit_bias": {"1": -200}})
    assert err.value.field == "logit_bias"
