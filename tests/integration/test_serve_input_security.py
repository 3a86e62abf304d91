"""Hostile and unsupported input, and API keys, through real Serve HTTP and gRPC (mock engine, no model).

Two mock-engine applications on the session's Ray cluster: /open (no keys) and /keyed (api_keys set).
Every refusal is an OpenAI error body naming the field; with keys, every route that reveals or changes
anything answers 401 without the key, /health stays open, and no key reaches any log file.
"""

from __future__ import annotations

import glob
import os
import uuid

import grpc
import httpx
import pytest

from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
from bullet_ray.serve.proto.generate_pb2_grpc import GeneratorStub

pytestmark = [pytest.mark.ray]

KEY = "sk-" + uuid.uuid4().hex  # unique, so a grep of the logs finds only this test's key
WRONG_KEY = "sk-wrong-" + uuid.uuid4().hex
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 2}
COMPLETION = {"model": "mock", "prompt": "a b c", "max_tokens": 2}


@pytest.fixture(scope="module")
def urls(serve_url):
    from ray import serve

    from bullet_ray.serve.app import build_app
    from bullet_ray.serve.mock_engine import mock_engine_factory

    base = {"engine": {"model": "mock"}, "engine_num_cpus": 0}
    serve.run(build_app(base, mock_engine_factory()), name="open", route_prefix="/open")
    serve.run(build_app({**base, "api_keys": [KEY]}, mock_engine_factory()), name="keyed", route_prefix="/keyed")
    yield f"{serve_url}/open", f"{serve_url}/keyed"
    serve.delete("open")
    serve.delete("keyed")


def _assert_openai_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param and err["message"]
    return err


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("chat/completions", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("completions", {"echo": True}, "echo"),
])
def test_unsupported_features_get_400_naming_the_field(urls, path, extra, param):
    body = {**(CHAT if path.startswith("chat") else COMPLETION), **extra}
    err = _assert_openai_error(httpx.post(f"{urls[0]}/v1/{path}", json=body, timeout=30), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream_options", ["yes", 3, {"include_usage": "maybe"}])
def test_stream_options_of_the_wrong_type_gets_422(urls, stream_options):
    body = {**CHAT, "stream": True, "stream_options": stream_options}
    err = _assert_openai_error(httpx.post(f"{urls[0]}/v1/chat/completions", json=body, timeout=30), 422,
                               "stream_options" if not isinstance(stream_options, dict) else
                               "stream_options.include_usage")
    assert err["type"] == "invalid_request_error"


def test_text_response_format_and_harmless_fields_are_served(urls):
    body = {**COMPLETION, "response_format": {"type": "text"}, "tool_choice": "none", "user": "u", "store": False,
            "best_of": 1, "metadata": {"k": "v"}}
    r = httpx.post(f"{urls[0]}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == " t3 t4"


def test_malformed_bodies_get_openai_errors(urls):
    r = httpx.post(f"{urls[0]}/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(f"{urls[0]}/v1/completions", json=[1, 2], timeout=30)
    assert r.status_code == 422 and "error" in r.json()
    _assert_openai_error(httpx.post(f"{urls[0]}/v1/chat/completions", json={**CHAT, "messages": []}, timeout=30),
                         422, "messages")


# ---------------------------------------------------------------------------------------------- keys

PROTECTED = [("GET", "v1/models", None), ("GET", "v1/internal/stats", None), ("GET", "openapi.json", None),
             ("POST", "v1/completions", COMPLETION), ("POST", "v1/chat/completions", CHAT)]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_route_that_reveals_or_changes_anything_needs_the_key(urls, method, path, body):
    url = f"{urls[1]}/{path}"
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}, {"Authorization": KEY},
                    {"Authorization": f"Basic {KEY}"}):
        r = httpx.request(method, url, json=body, headers=headers, timeout=30)
        err = _assert_openai_error(r, 401, None)
        assert err["type"] == "authentication_error"
        assert KEY not in r.text and WRONG_KEY not in r.text
    r = httpx.request(method, url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    if path == "v1/chat/completions":  # past the key: the mock engine has no chat template
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    else:
        assert r.status_code == 200, r.text


def test_the_key_is_checked_before_the_body(urls):
    """Without a key even a malformed body gets 401, not a 422 that would describe the schema."""
    for body in ({"prompt": 5}, {"messages": []}, [1, 2]):
        r = httpx.post(f"{urls[1]}/v1/completions", json=body, timeout=30)
        _assert_openai_error(r, 401, None)


def test_health_stays_open_and_the_open_app_needs_no_key(urls):
    assert httpx.get(f"{urls[1]}/health", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{urls[0]}/v1/models", timeout=30).status_code == 200
    spec = httpx.get(f"{urls[0]}/openapi.json", timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    assert httpx.get(f"{urls[0]}/docs", timeout=30).status_code == 404  # no Swagger page


def test_grpc_needs_the_key(urls, ray_session):
    with grpc.insecure_channel(ray_session.grpc_address) as channel:
        stub = GeneratorStub(channel)
        for extra in ((), (("authorization", f"Bearer {WRONG_KEY}"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(GenerateRequest(prompt="a b c", max_tokens=2),
                                   metadata=(("application", "keyed"), *extra)))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in (e.value.details() or "")
        ok = list(stub.Generate(GenerateRequest(prompt="a b c", max_tokens=2),
                                metadata=(("application", "keyed"), ("authorization", f"Bearer {KEY}"))))
        assert "".join(r.text for r in ok) == " t3 t4"
        with pytest.raises(grpc.RpcError) as e:  # same validation as HTTP
            list(stub.Generate(GenerateRequest(prompt_token_ids=[-1], max_tokens=2),
                               metadata=(("application", "keyed"), ("authorization", f"Bearer {KEY}"))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in e.value.details()


def test_no_key_reaches_any_log(urls, ray_session):
    """After the requests above (right and wrong keys, HTTP and gRPC), grep every log file of the cluster."""
    import ray

    headers = {"Authorization": f"Bearer {KEY}"}
    httpx.post(f"{urls[1]}/v1/completions", json={**COMPLETION, "tools": [{"x": 1}]}, headers=headers, timeout=30)
    httpx.post(f"{urls[1]}/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {WRONG_KEY}"},
               timeout=30)
    logs_dir = ray._private.worker._global_node.get_logs_dir_path()
    files = [p for p in glob.glob(os.path.join(logs_dir, "**", "*"), recursive=True) if os.path.isfile(p)]
    assert any("serve" in p for p in files)  # the Serve replica and proxy logs are there
    for path in files:
        with open(path, "rb") as f:
            data = f.read()
        assert KEY.encode() not in data and WRONG_KEY.encode() not in data, path
