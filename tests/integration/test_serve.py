"""The Serve application on a real local Ray cluster: `deploy/local.yaml`'s app (embedded SmolLM2, workers
as Ray actors) through the official openai client, plus a mock-engine app for auth and overload."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import yaml
from openai import OpenAI

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def local_yaml_args() -> dict:
    with open(os.path.join(ROOT, "deploy", "local.yaml")) as f:
        return yaml.safe_load(f)["applications"][0]["args"]


@pytest.fixture(scope="module")
def app(serve_url):
    from ray import serve

    from bullet_ray.serve import build_app
    from bullet_ray.serve.app import build_app as build_app_with_engine
    from bullet_ray.serve.mock_engine import mock_engine_factory

    serve.run(build_app(local_yaml_args()), name="bullet", route_prefix="/")
    mock_args = {"engine": {"model": "mock"}, "max_waiting_per_engine": 2, "api_keys": ["sekret"],
                 "engine_num_cpus": 0}
    serve.run(build_app_with_engine(mock_args, mock_engine_factory(token_delay_s=0.01, first_token_delay_s=0.5)),
              name="mock", route_prefix="/mock")
    yield serve_url
    serve.delete("bullet")
    serve.delete("mock")


@pytest.fixture(scope="module")
def client(app):
    return OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from bullet_ray.models.loader import cache_embedded, load_tokenizer

    return load_tokenizer(cache_embedded())


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    from bullet_ray.models.loader import cache_embedded

    return AutoModelForCausalLM.from_pretrained(cache_embedded(), dtype=torch.float32).eval()


def test_builder_is_what_serve_run_calls():
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from bullet_ray.serve import build_app

    app = call_user_app_builder_with_args_if_necessary(build_app, local_yaml_args())
    assert isinstance(app, Application)


def test_models_and_health(client, app):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    assert httpx.get(f"{app}/health").json() == {"status": "ok"}


def test_chat_greedy_text_equals_the_engine_core(client, tokenizer, hf_model, hf_greedy):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=24)
    ids = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False)
    ref = hf_greedy(hf_model, ids, 24)
    ref = ref[:ref.index(2)] if 2 in ref else ref  # <|im_end|> (id 2) ends the answer
    assert r.choices[0].message.content == tokenizer.decode(ref, skip_special_tokens=True)
    assert r.choices[0].message.content.startswith("The capital of France is Paris.")
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref) + 1  # the stop token counts as generated


def test_streaming_completion_matches_non_streaming_and_counts_usage(client, tokenizer):
    kw = dict(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=0)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens == len(tokenizer.encode("Once upon a time")) == full.usage.prompt_tokens
    assert usage.completion_tokens == 12 == len(full.choices[0].logprobs.tokens)
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_streaming_with_n_and_seed(client):
    kw = dict(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=8, temperature=1.0, seed=11, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    stream = client.chat.completions.create(stream=True, **kw)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [c.message.content for c in a.choices]


def test_prompt_as_token_ids_and_max_completion_tokens(client, tokenizer):
    ids = tokenizer.encode("The sky is")
    r = client.completions.create(model="smollm2-135m-instruct", prompt=ids, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 5
    c = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                       max_completion_tokens=3)
    assert c.usage.completion_tokens == 3 and c.choices[0].finish_reason == "length"


@pytest.mark.parametrize("body,status,param", [
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ({"model": "smollm2-135m-instruct", "prompt": list(range(9000)), "max_tokens": 4}, 413, "max_tokens"),
    ({"model": "smollm2-135m-instruct"}, 422, "prompt"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": "many"}, 422, "max_tokens"),
])
def test_bad_requests_get_openai_error_bodies(app, body, status, param):
    r = httpx.post(f"{app}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"]


def test_unknown_route_is_404(app):
    r = httpx.get(f"{app}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_every_kv_block(app):
    body = {"model": "smollm2-135m-instruct", "prompt": "Tell me a long story", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{app}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        stats = httpx.get(f"{app}/v1/internal/stats").json()
        assert stats["num_free_kv_blocks"] < stats["num_kv_blocks"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = httpx.get(f"{app}/v1/internal/stats").json()
        if stats["num_free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_running"] == 0:
            break
        time.sleep(0.2)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_api_key_is_required_when_configured(app):
    body = {"model": "mock", "prompt": "a b c", "max_tokens": 2}
    r = httpx.post(f"{app}/mock/v1/completions", json=body, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(f"{app}/mock/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t3 t4"


def test_overload_answers_429_with_retry_after_and_loses_nothing(app):
    body = {"model": "mock", "prompt": "a b c", "max_tokens": 3}
    headers = {"Authorization": "Bearer sekret"}

    async def fire() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{app}/mock/v1/completions", json=body, headers=headers)
                                          for _ in range(12)))

    responses = asyncio.run(fire())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 2
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
        else:
            assert r.json()["choices"][0]["text"] == " t3 t4 t5"


def test_benchmark_client_against_the_local_server(app):
    from benchmarks.serve_bench import BenchConfig, run_benchmark
    from benchmarks.traces import WorkloadConfig, build_workload

    workload = WorkloadConfig(dataset="random", num_prompts=4, rate_rps=20.0, seed=5, random_input_tokens=24,
                              random_output_tokens=6, random_spread=0.6)
    result = asyncio.run(run_benchmark(BenchConfig(base_url=app, workload=workload, slos=["relaxed"],
                                                   is_progress_shown=False)))
    for spec, rec in zip(build_workload(workload), result.records):
        assert rec.success, rec.error
        assert rec.is_usage_reported and rec.prompt_tokens == spec.prompt_tokens  # exact-length prompts
        assert rec.output_tokens == spec.output_tokens  # forced output lengths
        assert rec.ttft_s > 0 and rec.e2e_s >= rec.ttft_s
    assert result.summary["num_completed"] == 4
