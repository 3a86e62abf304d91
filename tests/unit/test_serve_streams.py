"""ChoiceStreams over local async generators (no Ray): what `merged` yields and raises, for one choice (read
straight from its stream) and for several (one task each into a queue), and that closing frees the streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bullet_ray.engine.outputs import RequestOutput
from bullet_ray.serve.engine_deployment import GenerateError
from bullet_ray.serve.local_handle import LocalHandle
from bullet_ray.serve.streams import ApiError, ChoiceStreams


def _out(rid: str, token: int, num_output: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, token_ids_delta=[token], text_delta=f" <{token}>", logprobs_delta=None,
                         num_prompt_tokens=4, num_output_tokens=num_output, finished=finished,
                         finish_reason="length" if finished else None)


class _Engine:
    """`generate` streams `num_tokens` outputs per request, then (optionally) fails the way it is told."""

    def __init__(self, num_tokens: int = 3, fail_after: int | None = None, failure: Any = None) -> None:
        self.num_tokens = num_tokens
        self.fail_after = fail_after
        self.failure = failure
        self.closed: list[str] = []

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        rid = request["request_id"]
        try:
            for i in range(self.num_tokens):
                if self.fail_after is not None and i == self.fail_after:
                    if isinstance(self.failure, BaseException):
                        raise self.failure
                    yield self.failure
                    return
                await asyncio.sleep(0)
                yield _out(rid, 100 * int(rid[1:]) + i, i + 1, finished=i == self.num_tokens - 1)
        finally:
            self.closed.append(rid)


async def _collect(engine: _Engine, num_choices: int) -> tuple[list[tuple[int, RequestOutput]], ChoiceStreams]:
    streams = ChoiceStreams(LocalHandle(engine), [{"request_id": f"r{i}"} for i in range(num_choices)], 1)
    await streams.start()
    got = []
    try:
        async for i, out in streams.merged():
            got.append((i, out))
    finally:
        streams.cancel()
        await asyncio.sleep(0)
    return got, streams


@pytest.mark.parametrize("num_choices", [1, 3])
def test_every_choice_streams_its_outputs_in_order_until_finished(num_choices):
    got, _ = asyncio.run(_collect(_Engine(num_tokens=4), num_choices))
    for choice in range(num_choices):
        mine = [out for i, out in got if i == choice]
        assert [o.token_ids_delta[0] for o in mine] == [100 * choice + k for k in range(4)]
        assert [o.finished for o in mine] == [False, False, False, True]
    assert len(got) == 4 * num_choices


@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_refusal_mid_stream_raises_its_api_error(num_choices):
    refusal = GenerateError(503, "engine unavailable: gone", "server_error", retry_after_s=2)
    with pytest.raises(ApiError) as e:
        asyncio.run(_collect(_Engine(num_tokens=4, fail_after=2, failure=refusal), num_choices))
    assert (e.value.status, e.value.message, e.value.retry_after_s) == (503, "engine unavailable: gone", 2)


@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_replica_failing_mid_stream_is_a_503_with_retry_after(num_choices):
    with pytest.raises(ApiError) as e:
        asyncio.run(_collect(_Engine(num_tokens=4, fail_after=1, failure=RuntimeError("actor died")), num_choices))
    assert e.value.status == 503 and e.value.retry_after_s == 1 and "RuntimeError" in e.value.message


def test_a_first_output_that_finishes_ends_the_choice():
    got, _ = asyncio.run(_collect(_Engine(num_tokens=1), 1))
    assert [(i, o.finished) for i, o in got] == [(0, True)]


@pytest.mark.parametrize("num_choices", [1, 2])
def test_leaving_early_closes_every_engine_stream(num_choices):
    engine = _Engine(num_tokens=50)

    async def first_two() -> None:
        streams = ChoiceStreams(LocalHandle(engine), [{"request_id": f"r{i}"} for i in range(num_choices)], 1)
        await streams.start()
        merged = streams.merged()
        try:
            for _ in range(2):
                await merged.__anext__()
        finally:
            await merged.aclose()
            streams.cancel()
            for _ in range(5):
                await asyncio.sleep(0)

    asyncio.run(first_two())
    assert sorted(engine.closed) == [f"r{i}" for i in range(num_choices)]


@pytest.mark.parametrize("num_choices", [1, 2])
def test_a_stream_that_ends_before_its_finished_output_is_a_503(num_choices):
    class _Cut(_Engine):
        async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
            rid = request["request_id"]
            for i in range(2):  # never a finished output
                await asyncio.sleep(0)
                yield _out(rid, i, i + 1)

    with pytest.raises(ApiError) as e:
        asyncio.run(_collect(_Cut(), num_choices))
    assert e.value.status == 503 and e.value.retry_after_s == 1


def test_streamed_logprobs_of_updates_without_text_go_out_with_the_next_chunk():
    """An update with no text yet (half a character, a held-back stop-string prefix) still carries its token's
    logprob: the SSE stream sends it with the choice's next chunk, so every token has one."""
    from types import SimpleNamespace

    from bullet_ray.engine.outputs import TokenLogprob
    from bullet_ray.serve.ingress import Ingress

    def out(token: int, text: str, finished: bool = False) -> RequestOutput:
        return RequestOutput(request_id="r0", token_ids_delta=[token], text_delta=text,
                             logprobs_delta=[TokenLogprob(token, -0.1 * token)], num_prompt_tokens=4,
                             num_output_tokens=token, finished=finished, finish_reason="length" if finished else None)

    class _TextlessFirst(_Engine):
        async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
            for item in (out(1, ""), out(2, "ab"), out(3, ""), out(4, "c", finished=True)):
                await asyncio.sleep(0)
                yield item

    async def texts(ids: set[int]) -> dict[int, str]:
        return {t: f"<{t}>" for t in ids}

    async def go() -> list[str]:
        params = SimpleNamespace(logprobs=0)
        streams = ChoiceStreams(LocalHandle(_TextlessFirst()), [{"request_id": "r0", "params": params}], 1)
        await streams.start()
        fake = SimpleNamespace(cfg=SimpleNamespace(model_name="m"), _token_texts=texts)
        return [chunk async for chunk in Ingress.func_or_class._sse_stream(fake, streams, "id", False, False)]

    chunks = [json.loads(c.removeprefix("data: ").strip()) for c in asyncio.run(go()) if "[DONE]" not in c]
    texts_sent = [c["choices"][0]["text"] for c in chunks]
    logprobs = [lp for c in chunks for lp in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert texts_sent == ["ab", "c"] and logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])


@pytest.mark.parametrize("failure", ["replica", "deployment", "other"])
def test_no_replica_to_answer_is_a_503_and_anything_else_an_openai_500(failure):
    """Serve's 'no replica' errors before the first output are a 503 with Retry-After (as a dead replica is);
    an error no handler knows still answers with an OpenAI-style body (SDKs parse it), not a plain-text 500."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    from bullet_ray.serve.ingress import _unexpected_error

    if failure == "other":
        response = asyncio.run(_unexpected_error(None, KeyError("boom")))  # type: ignore[arg-type]
        body = json.loads(response.body)
        assert response.status_code == 500 and body["error"]["type"] == "server_error"
        assert "KeyError" in body["error"]["message"]
        return
    error = ReplicaUnavailableError("r1") if failure == "replica" else \
        DeploymentUnavailableError(DeploymentID(name="engine", app_name="app"))
    with pytest.raises(ApiError) as e:
        asyncio.run(_collect(_Engine(fail_after=0, failure=error), 1))
    assert e.value.status == 503 and e.value.retry_after_s == 1


# n > 1: a refused choice ----------------------------------------------------------------------------------------
def _queue_bound_replica(first_token_delay_s: float) -> Any:
    """An engine replica over the mock engine that admits one waiting request: of n = 2 choices the first is
    admitted (and waits first_token_delay_s for its first token), the second is refused with 429."""
    from bullet_ray.serve.config import BulletAppConfig
    from bullet_ray.serve.engine_deployment import EngineReplica
    from bullet_ray.serve.mock_engine import mock_engine_factory

    cfg = BulletAppConfig(engine={"model": "mock"}, max_waiting_per_engine=1)
    return EngineReplica(cfg.model_dump(), mock_engine_factory(first_token_delay_s=first_token_delay_s))


def _choice_requests(num_choices: int) -> list[dict[str, Any]]:
    from bullet_ray.engine.sampling_params import SamplingParams

    return [{"prompt": "a b c", "params": SamplingParams(max_tokens=4), "request_id": f"r{i}", "prompt_index": 0}
            for i in range(num_choices)]


async def _settle() -> None:
    for _ in range(10):  # the cancelled choices' tasks and generator closes run
        await asyncio.sleep(0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_refused_choice_is_a_prompt_429_and_the_other_choices_are_aborted(stream):
    """n = 2, the second choice refused by the queue bound while the first waits 5 s for its first token: the
    ingress answers 429 at once (not after the other choice's first token) and aborts the admitted choice, so the
    engine holds no request and no KV block afterwards."""
    import time
    from types import SimpleNamespace

    from bullet_ray.serve.ingress import Ingress

    replica = _queue_bound_replica(first_token_delay_s=5.0)
    ingress = SimpleNamespace(engine=LocalHandle(replica), cfg=replica.cfg)
    body = SimpleNamespace(stream=stream, stream_options=None)

    async def go() -> tuple[ApiError, float]:
        start = time.monotonic()
        with pytest.raises(ApiError) as e:
            await Ingress.func_or_class._respond(ingress, body, _choice_requests(2), chat=False)
        elapsed_s = time.monotonic() - start
        await _settle()
        return e.value, elapsed_s

    error, elapsed_s = asyncio.run(go())
    assert (error.status, error.err_type, error.retry_after_s) == (429, "rate_limit_error", 1)
    assert elapsed_s < 1.0
    stats = replica.engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.num_free_kv_blocks) == (0, 0, stats.num_kv_blocks)
    assert replica.stats()["num_rejected_total"] == 1


def test_serve_back_pressure_on_one_choice_is_a_prompt_429_that_closes_the_others():
    """Serve's own refusal (BackPressureError: the replicas' queues are full) of one choice, while another waits
    for its first token: 429 at once, and the waiting choice's engine stream is closed (not left running)."""
    from ray.serve.exceptions import BackPressureError

    class _OneRefused(_Engine):
        async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
            rid = request["request_id"]
            try:
                if rid == "r1":
                    raise BackPressureError(num_queued_requests=4, max_queued_requests=4)
                await asyncio.sleep(5.0)
                yield _out(rid, 0, 1, finished=True)
            finally:
                self.closed.append(rid)

    engine = _OneRefused()

    async def go() -> tuple[ApiError, list[str]]:
        streams = ChoiceStreams(LocalHandle(engine), [{"request_id": f"r{i}"} for i in range(3)], 1)
        with pytest.raises(ApiError) as e:
            await asyncio.wait_for(streams.start(), timeout=1.0)
        await _settle()
        return e.value, sorted(engine.closed)  # read before asyncio.run cancels whatever still runs

    error, closed = asyncio.run(go())
    assert (error.status, error.err_type) == (429, "rate_limit_error")
    assert closed == ["r0", "r1", "r2"]


def test_a_plain_engine_call_maps_ray_failures_to_api_errors():
    """/tokenize, /detokenize and the stats route: a dead replica is a 503, a saturated deployment a 429, both with
    Retry-After; an answer passes through."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError

    from bullet_ray.serve.streams import engine_answer

    async def answer(value=None, error=None):
        if error is not None:
            raise error
        return value

    assert asyncio.run(engine_answer(answer({"ok": 1}), 5)) == {"ok": 1}
    for error, status in ((RayActorError(), 503), (BackPressureError(num_queued_requests=3, max_queued_requests=2), 429)):
        with pytest.raises(ApiError) as e:
            asyncio.run(engine_answer(answer(error=error), 5))
        assert (e.value.status, e.value.retry_after_s) == (status, 5)
