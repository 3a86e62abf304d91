"""Fuzz the HTTP API from its own OpenAPI spec (schemathesis) through real Serve, on the mock engine.

Every operation of /openapi.json gets schema-valid (positive) and schema-breaking (negative) requests;
whatever comes in, the server must never answer 5xx, every 4xx must carry OpenAI's error body
{"error": {message, type, param, code}}, and every 200 must be a well-formed answer. Bounded for CI:
a few dozen examples per operation, no deadline, no example database (about a minute on 2 cores).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 25}
GET_EXAMPLES = 3


@pytest.fixture(scope="module")
def fuzz_url(serve_url):
    from ray import serve

    from bullet_ray.serve.app import build_app
    from bullet_ray.serve.mock_engine import mock_engine_factory

    # a short context keeps every generated request small (at most 64 tokens per choice)
    args = {"engine": {"model": "mock"}, "engine_num_cpus": 0, "default_max_tokens": 8}
    serve.run(build_app(args, mock_engine_factory(max_model_len=64)), name="fuzz", route_prefix="/fuzz")
    yield f"{serve_url}/fuzz"
    serve.delete("fuzz")


def check_response(status: int, content_type: str, text: str) -> None:
    """The contract under fuzzing: no 5xx; 4xx bodies OpenAI-shaped; 200 bodies well-formed."""
    assert status < 500, f"HTTP {status}: {text[:500]}"
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] in {"invalid_request_error", "not_found_error", "authentication_error",
                               "rate_limit_error"}, err
        assert err["code"] == status and (err["param"] is None or isinstance(err["param"], str)), err
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-500:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        json.loads(text)


def _operations(url: str) -> list[Any]:
    spec = httpx.get(f"{url}/openapi.json", timeout=60).json()
    schema = schemathesis.openapi.from_dict(spec)
    return [result.ok() for result in schema.get_all_operations()]


def test_fuzz_every_operation(fuzz_url):
    operations = _operations(fuzz_url)
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/tokenize", "/detokenize"} <= paths, paths
    num_calls = {"count": 0}
    import requests

    with requests.Session() as session:
        for op in operations:
            for mode, max_examples in EXAMPLES.items():
                if op.method.upper() == "GET":  # no parameters: nothing to break, a few plain calls
                    if mode is GenerationMode.NEGATIVE:
                        continue
                    max_examples = GET_EXAMPLES

                @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def run(case: Any) -> None:
                    r = case.call(base_url=fuzz_url, session=session, timeout=60)
                    num_calls["count"] += 1
                    content_type = r.headers.get("content-type") or [""]  # schemathesis: a list per header
                    check_response(r.status_code, content_type[0], r.text)

                run()
    assert num_calls["count"] >= 60
