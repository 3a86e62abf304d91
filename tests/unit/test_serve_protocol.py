"""Which OpenAI request fields are refused (400 naming the field), which are malformed (422), which are
accepted and ignored; and the API-key comparison. No Ray, no HTTP."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bullet_ray.serve.auth import is_authorized
from bullet_ray.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedParameter

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"prompt": "hi"}


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_choice": ["a", "b"]}, "guided_choice"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream=true
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "messages[1].tool_calls"),
])
def test_chat_refuses_unsupported_features_naming_the_field(extra, param):
    body = ChatCompletionRequest(**{**CHAT, **extra})
    with pytest.raises(UnsupportedParameter) as e:
        body.check_supported()
    assert e.value.param == param and str(e.value)


@pytest.mark.parametrize(("extra", "param"), [
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True}, "echo"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_completion_refuses_unsupported_features(extra, param):
    with pytest.raises(UnsupportedParameter) as e:
        CompletionRequest(**{**COMPLETION, **extra}).check_supported()
    assert e.value.param == param


@pytest.mark.parametrize("extra", [
    {"tools": []}, {"tool_choice": "none"}, {"function_call": "none"}, {"response_format": {"type": "text"}},
    {"logit_bias": {}}, {"logit_bias": {"50256": -100}}, {"modalities": ["text"]}, {"user": "u1"}, {"store": False}, {"metadata": {"a": "b"}},
    {"service_tier": "auto"}, {"parallel_tool_calls": False}, {"reasoning_effort": "low"},
    {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
])
def test_harmless_fields_are_accepted(extra):
    body = ChatCompletionRequest(**{**CHAT, **extra})
    body.check_supported()


def test_ignored_fields_are_listed_by_name():
    body = ChatCompletionRequest(**CHAT, store=True, metadata={"k": "v"})
    assert body.ignored_fields() == ["metadata", "store"]
    assert CompletionRequest(prompt="x", best_of=1).ignored_fields() == ["best_of"]


@pytest.mark.parametrize("stream_options", ["yes", 1, [True], {"include_usage": "maybe"}, {"include_usage": 1}])
def test_stream_options_of_the_wrong_type_is_a_schema_error(stream_options):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, stream=True, stream_options=stream_options)
    assert e.value.errors()[0]["loc"][0] == "stream_options"


def test_api_key_check():
    keys = ["k1", "k2-longer"]
    assert is_authorized(None, [])
    assert is_authorized("Bearer k1", keys) and is_authorized("Bearer k2-longer", keys)
    for bad in (None, "", "k1", "Bearer ", "Bearer k", "Bearer k1x", "Basic k1", "bearer k1", "Bearer k2"):
        assert not is_authorized(bad, keys), bad
    assert not is_authorized("Bearer \udcff", keys)  # undecodable bytes do not raise


def test_api_key_is_compared_in_constant_time_against_every_key(monkeypatch):
    import hmac

    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr("bullet_ray.serve.auth.hmac.compare_digest", spy)
    assert is_authorized("Bearer k1", ["k1", "k2", "k3"])
    assert [b for _, b in calls] == [b"k1", b"k2", b"k3"]  # no early exit on the first match


def test_logit_bias_reaches_the_sampling_fields_and_a_non_number_is_a_schema_error():
    body = CompletionRequest(**COMPLETION, logit_bias={"50256": -100, "11": 2.5})
    assert body.sampling_fields()["logit_bias"] == {"50256": -100.0, "11": 2.5}
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(**CHAT, logit_bias={"1": "high"})
    assert e.value.errors()[0]["loc"][0] == "logit_bias"


def test_tokenize_takes_exactly_one_of_prompt_and_messages():
    from bullet_ray.serve.openai_protocol import DetokenizeRequest, TokenizeRequest

    assert TokenizeRequest(prompt="hi").engine_request() == {"prompt": "hi"}
    assert TokenizeRequest(prompt=[1, 2]).engine_request() == {"prompt": [1, 2]}
    chat = TokenizeRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                               "text": "b"}]}])
    assert chat.engine_request() == {"messages": [{"role": "user", "content": "ab"}]}
    user = [{"role": "user", "content": "y"}]
    assert TokenizeRequest(prompt="x", add_special_tokens=True).engine_request() == {"prompt": "x"}  # vLLM's defaults
    assert TokenizeRequest(messages=user, add_special_tokens=False, add_generation_prompt=True).engine_request()
    for body, param in (({}, "prompt"), ({"prompt": "x", "messages": user}, "messages"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                         "messages[0].content[0]"),
                        ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]},
                         "messages[0].tool_calls"),
                        ({"prompt": "x", "add_special_tokens": False}, "add_special_tokens"),
                        ({"messages": user, "add_special_tokens": True}, "add_special_tokens"),
                        ({"messages": user, "add_generation_prompt": False}, "add_generation_prompt"),
                        ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt")):
        with pytest.raises(UnsupportedParameter) as e:
            TokenizeRequest(**body).engine_request()
        assert e.value.param == param
    for bad in ({"prompt": "x", "add_special_tokens": "maybe"}, {"messages": []}, {"prompt": "x", "chat_template": "t"}):
        with pytest.raises(ValidationError):
            TokenizeRequest(**bad)
    with pytest.raises(ValidationError):
        DetokenizeRequest(tokens=["a"])
