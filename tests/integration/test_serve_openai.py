"""The Serve application on the session's local Ray cluster: `deploy/local.yaml`'s args through
`serve.run(build_app(args))` (embedded SmolLM2, the real LLMEngine, prefill/decode workers as Ray actors)
driven by the official openai client, httpx and the gRPC stub; plus a mock-engine app for auth and
overload. (`serve run deploy/local.yaml` itself, the CLI, is exercised by test_serve_cli.py.)"""

from __future__ import annotations

import asyncio
import os
import re
import time

import grpc
import httpx
import pytest
import yaml
from openai import OpenAI

from bullet_ray.serve.proto.generate_pb2 import GenerateRequest
from bullet_ray.serve.proto.generate_pb2_grpc import GeneratorStub

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
def grpc_stub(app, ray_session):
    with grpc.insecure_channel(ray_session.grpc_address) as channel:
        yield GeneratorStub(channel)


@pytest.fixture(scope="module")
def client(app):
    return OpenAI(base_url=f"{app}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer():
    from bullet_ray.models.loader import cache_embedded, load_tokenizer

    return load_tokenizer(cache_embedded())


@pytest.fixture(scope="module")
def engine_core():
    """What the engine core (LLMEngine.generate, standalone, deploy/local.yaml's engine args) answers."""
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams
    from bullet_ray.serve.config import BulletAppConfig

    cfg = BulletAppConfig(**local_yaml_args())
    engine = LLMEngine(cfg.engine.to_engine_config(), served_model_name=cfg.model_name)
    try:
        chat_ids = list(engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                             return_dict=False))
        chat, story = engine.generate([chat_ids, "Once upon a time"],
                                      [SamplingParams(temperature=0, max_tokens=24),
                                       SamplingParams(temperature=0, max_tokens=12)])
    finally:
        engine.shutdown()
    return {"chat_ids": chat_ids, "chat": chat, "story": story}


def test_builder_is_what_serve_run_calls():
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from bullet_ray.serve import build_app

    app = call_user_app_builder_with_args_if_necessary(build_app, local_yaml_args())
    assert isinstance(app, Application)


def test_models_and_health(client, app):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]
    assert httpx.get(f"{app}/health").json() == {"status": "ok"}


def test_chat_greedy_text_equals_the_engine_core(client, engine_core):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=24)
    ref = engine_core["chat"]
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.content.startswith("The capital of France is Paris.")
    assert r.choices[0].finish_reason == ref.finish_reason == "stop"
    assert r.usage.prompt_tokens == len(engine_core["chat_ids"]) == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)  # the stop token counts as generated


def test_completion_greedy_text_equals_the_engine_core(client, engine_core):
    r = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=12,
                                  temperature=0)
    assert r.choices[0].text == engine_core["story"].text
    assert r.usage.completion_tokens == len(engine_core["story"].token_ids) == 12


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


def test_logprobs_name_tokens_by_their_text(client):
    chat = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                          max_tokens=6, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token  # greedy: the top token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-4) and c.logprob <= 0
    comp = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=5,
                                     temperature=0, logprobs=1)
    lp = comp.choices[0].logprobs
    assert "".join(lp.tokens) == comp.choices[0].text and len(lp.token_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_stop_string_ends_the_text_before_it(client):
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, temperature=0,
                                       max_tokens=24, stop=[" France"])
    assert r.choices[0].message.content == "The capital of" and r.choices[0].finish_reason == "stop"


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


def test_logit_bias_steers_every_token_on_both_sides(client, tokenizer, engine_core):
    """+100 on one token makes greedy pick it at every step (the first on the prefill worker, the rest on decode:
    the bias travels with the request); -100 on the greedy story's first token makes greedy pick another."""
    forced = tokenizer.encode(" blue")[-1]
    r = client.completions.create(model="smollm2-135m-instruct", prompt="The sky is", max_tokens=4, temperature=0,
                                  logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tokenizer.decode([forced] * 4) and r.usage.completion_tokens == 4
    first = engine_core["story"].token_ids[0]
    banned = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text and banned.choices[0].text != tokenizer.decode([first])


@pytest.mark.parametrize("body,status,param", [
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"model": "no-such-model", "prompt": "hi"}, 404, "model"),
    ({"model": "smollm2-135m-instruct", "prompt": list(range(9000)), "max_tokens": 4}, 413, "max_tokens"),
    ({"model": "smollm2-135m-instruct"}, 422, "prompt"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": "many"}, 422, "max_tokens"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"model": "smollm2-135m-instruct", "prompt": "hi", "logit_bias": {"1": "high"}}, 422, "logit_bias.1"),
])
def test_bad_requests_get_openai_error_bodies(app, body, status, param):
    r = httpx.post(f"{app}/v1/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and err["message"]


def test_tokenize_and_detokenize_give_what_the_engine_runs(app, tokenizer, engine_core):
    """vLLM's /tokenize and /detokenize: text through the engine's tokenizer, chat messages through its template
    (the ids a chat completion runs), ids back to text; bad input gets an OpenAI error naming the field."""
    ids = tokenizer.encode("The sky is")
    r = httpx.post(f"{app}/tokenize", json={"model": "smollm2-135m-instruct", "prompt": "The sky is"}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids) and r.json()["max_model_len"] > len(ids)
    chat = httpx.post(f"{app}/tokenize", json={"messages": QUESTION}, timeout=30).json()
    assert chat["tokens"] == engine_core["chat_ids"]
    back = httpx.post(f"{app}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    assert httpx.post(f"{app}/detokenize", json={"tokens": []}, timeout=30).json() == {"prompt": ""}
    for path, body, status, param in (("detokenize", {"tokens": [10**9]}, 400, "tokens"),
                                      ("tokenize", {"prompt": "x", "messages": QUESTION}, 400, "messages"),
                                      ("tokenize", {"prompt": ""}, 400, "prompt"),
                                      ("tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
                                      ("tokenize", {"prompt": "x", "add_special_tokens": False}, 400,
                                       "add_special_tokens"),
                                      ("tokenize", {"prompt": "x", "chat_template": "{{ x }}"}, 422, "chat_template")):
        r = httpx.post(f"{app}/{path}", json=body, timeout=30)
        assert r.status_code == status, (path, body, r.text)
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


def test_internal_stats_report_each_engine_processs_garbage_collections(app):
    """The replica froze its heap once its engine started (engine.gc_freeze) and times its own collections beside
    the workers' (the gc_pause_seconds metric's source)."""
    httpx.post(f"{app}/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2},
               timeout=60).raise_for_status()
    gc = httpx.get(f"{app}/v1/internal/stats").json()["gc"]
    assert gc["front_frozen"] > 1000, gc
    processes = gc["processes"]
    assert "front" in processes and len(processes) >= 2, processes  # the front and the engine's workers
    assert all(p["collections"] >= 0 and p["seconds"] >= 0 for p in processes.values()), processes


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


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_choice_of_n_is_a_429_that_aborts_the_other_choices(app, stream):
    """n = 3 against the mock app's queue bound of 2: the third choice is refused, so the request is a 429 and
    the two admitted choices are aborted through Serve (the engine holds no request and no KV block after)."""
    body = {"model": "mock", "prompt": "a b c", "max_tokens": 3, "n": 3, "stream": stream}
    headers = {"Authorization": "Bearer sekret"}
    r = httpx.post(f"{app}/mock/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    assert r.headers["retry-after"] == "1"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(f"{app}/mock/v1/internal/stats", headers=headers).json()
        if stats["num_waiting"] == 0 and stats["num_running"] == 0:
            break
        time.sleep(0.1)
    assert (stats["num_waiting"], stats["num_running"]) == (0, 0)
    assert stats["num_free_kv_blocks"] == stats["num_kv_blocks"]


def test_benchmark_client_against_the_local_server(app):
    from bullet_ray.bench.serve_bench import BenchConfig, run_benchmark
    from bullet_ray.bench.traces import WorkloadConfig, build_workload

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


def test_echo_is_refused(app):
    r = httpx.post(f"{app}/v1/completions", json={"model": "smollm2-135m-instruct", "prompt": "hi", "echo": True},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_grpc_streams_the_same_text_as_http(client, grpc_stub):
    http = client.completions.create(model="smollm2-135m-instruct", prompt="Once upon a time", max_tokens=12,
                                     temperature=0)
    metadata = (("application", "bullet"),)
    responses = list(grpc_stub.Generate(GenerateRequest(prompt="Once upon a time", max_tokens=12, temperature=0.0),
                                        metadata=metadata))
    assert "".join(r.text for r in responses) == http.choices[0].text
    assert sum(len(r.token_ids) for r in responses) == 12
    last = responses[-1]
    assert last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (http.usage.prompt_tokens, 12)
    chat = list(grpc_stub.Generate(GenerateRequest(prompt="What is the capital of France?", chat=True,
                                                   max_tokens=8, temperature=0.0), metadata=metadata))
    assert "".join(r.text for r in chat).startswith("The capital of France")


def test_grpc_refusals_carry_status_codes(grpc_stub):
    metadata = (("application", "bullet"),)
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stub.Generate(GenerateRequest(prompt="hi", top_p=0.0), metadata=metadata))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(grpc_stub.Generate(GenerateRequest(prompt="hi", model="gpt-5"), metadata=metadata))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:  # the mock app wants an API key
        list(grpc_stub.Generate(GenerateRequest(prompt="a b c", max_tokens=2), metadata=(("application", "mock"),)))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = list(grpc_stub.Generate(GenerateRequest(prompt="a b c", max_tokens=2),
                                 metadata=(("application", "mock"), ("authorization", "Bearer sekret"))))
    assert "".join(r.text for r in ok) == " t3 t4"


def test_metrics_reach_the_node_exporter(app, ray_session, client):
    """vLLM-named metrics come out of Ray's per-node exporter as ray_bullet_<name>, tagged by model and engine.
    (Runs last in this module: the requests above produced the samples; Ray exports them periodically.)"""
    client.completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=3, temperature=0)
    wanted = ["ray_bullet_time_to_first_token_seconds_bucket", "ray_bullet_e2e_request_latency_seconds_count",
              "ray_bullet_generation_tokens_total", "ray_bullet_request_success_total",
              "ray_bullet_kv_cache_usage_perc", "ray_bullet_num_requests_waiting",
              "ray_bullet_sm_split_decode_sms", "ray_bullet_sm_split_prefill_sms", "ray_bullet_decode_step_seconds",
              "ray_bullet_predicted_ttft_seconds", "ray_bullet_graph_captures_serving",
              "ray_bullet_gc_pause_seconds_total", "ray_bullet_gc_collections_total"]

    def success_of_this_model(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("ray_bullet_request_success_total{")
                and 'finished_reason="length"' in line and 'model_name="smollm2-135m-instruct"' in line]

    def rejections_of_the_mock(text: str) -> re.Match | None:  # the overload test's 429s
        return re.search(r'ray_bullet_admissions_rejected_total\{[^}]*model_name="mock"', text)

    deadline = time.monotonic() + 90
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(ray_session.metrics_url, timeout=10).text
        if all(name in text for name in wanted) and success_of_this_model(text) and rejections_of_the_mock(text):
            break
        time.sleep(2)
    missing = [name for name in wanted if name not in text]
    assert not missing, missing
    assert success_of_this_model(text)
    assert rejections_of_the_mock(text)
    captures = [line for line in text.splitlines() if line.startswith("ray_bullet_graph_captures_serving{")
                and 'model_name="smollm2-135m-instruct"' in line]
    assert captures and all(float(line.rsplit(" ", 1)[1]) == 0.0 for line in captures)  # no graphs on CPU
