"""The gRPC Generate request -> engine request mapping and status codes (no Ray cluster)."""

from __future__ import annotations

import grpc
import pytest

from bullet_ray.serve.config import BulletAppConfig
from bullet_ray.serve.grpc_service import check_api_key, engine_request, grpc_status
from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
from bullet_ray.serve.streams import ApiError

CFG = BulletAppConfig(engine={"model": "mock"}, default_max_tokens=7, api_keys=["k"])


def test_text_ids_and_chat_prompts():
    req = engine_request(GenerateRequest(prompt="hi", temperature=0.0, seed=3, stop=["."]), CFG)
    assert req["prompt"] == "hi"
    p = req["params"]
    assert (p.temperature, p.seed, p.stop, p.max_tokens) == (0.0, 3, (".",), 7)
    assert engine_request(GenerateRequest(prompt_token_ids=[1, 2], max_tokens=2), CFG)["prompt"] == [1, 2]
    chat = engine_request(GenerateRequest(prompt="hi", chat=True, model="mock"), CFG)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in chat


@pytest.mark.parametrize("message,status,param", [
    (GenerateRequest(), 400, "prompt"),
    (GenerateRequest(prompt="a", prompt_token_ids=[1]), 400, "prompt"),
    (GenerateRequest(prompt="a", top_p=0.0), 400, "top_p"),
    (GenerateRequest(prompt="a", max_tokens=0), 400, "max_tokens"),
    (GenerateRequest(prompt="a", model="other"), 404, "model"),
    (GenerateRequest(prompt_token_ids=[1, -5]), 400, "prompt_token_ids"),
    (GenerateRequest(prompt="a", temperature=-1.0), 400, "temperature"),
    (GenerateRequest(prompt="a", top_k=-7), 400, "top_k"),
])
def test_refusals_name_the_field(message, status, param):
    with pytest.raises(ApiError) as e:
        engine_request(message, CFG)
    assert (e.value.status, e.value.param) == (status, param)


def test_api_key_and_status_mapping():
    check_api_key([("authorization", "Bearer k")], CFG)
    with pytest.raises(ApiError) as e:
        check_api_key([("authorization", "Bearer nope")], CFG)
    assert e.value.status == 401
    for metadata in ([], [("authorization", "k")], [("authorization", "Bearer k2")], [("x-api-key", "k")]):
        with pytest.raises(ApiError) as e:
            check_api_key(metadata, CFG)
        assert e.value.status == 401 and "k" not in e.value.message.replace("key", "")
    assert grpc_status(429) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert grpc_status(413) == grpc.StatusCode.INVALID_ARGUMENT
    assert grpc_status(500) == grpc.StatusCode.INTERNAL
