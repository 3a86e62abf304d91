"""The OpenAI-compatible HTTP ingress: /v1/completions, /v1/chat/completions, /v1/models, /health.

Streams are Server-Sent Events ending in `data: [DONE]`; with stream_options.include_usage a last chunk
carries the usage. Errors have OpenAI's body {"error": {message, type, param, code}}: 400 bad
parameters or an unsupported feature (tools, response_format other than text, ...: see
openai_protocol), 401 bad API key, 404 unknown model or route, 413 prompt too long or body too large,
422 malformed body, 429 saturated (with Retry-After).

With `api_keys` set, every route but /health needs `Authorization: Bearer <key>`: the API, the engine
stats and the OpenAPI spec (/openapi.json; the Swagger pages are off). Keys are never logged.
"""

# no `from __future__ import annotations`: FastAPI reads these annotations at run time

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import HTTPException, RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidSamplingParams
from bullet_ray.serve.auth import is_authorized
from bullet_ray.serve.config import BulletAppConfig
from bullet_ray.serve.grpc_service import generate_stream
from bullet_ray.serve.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    UnsupportedParameter,
    error_body,
)
from bullet_ray.serve.streams import ApiError, ChoiceStreams, engine_answer

logger = logging.getLogger(__name__)

# the spec is served by Ingress.openapi_spec (behind the API key); no Swagger/ReDoc pages
fastapi_app = FastAPI(title="bullet_ray", description="OpenAI-compatible API of bullet_ray", docs_url=None,
                      redoc_url=None, openapi_url=None)


class BodyLimit:
    """ASGI middleware: a request body over the app's `state.max_request_bytes` (the Ingress replica sets it from
    its config) is refused with 413 by its declared Content-Length before it is read, or, where none is declared
    (a chunked body), as soon as more than that has arrived: never read whole, parsed or tokenized."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        limit = getattr(getattr(scope.get("app"), "state", None), "max_request_bytes", None)
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(send, f"request body of {int(declared)} bytes exceeds {limit}")
            return
        received, started = 0, False

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(f"request body of more than {limit} bytes (sent without a length)")
            return message

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge as e:  # raised where no handler turned it into a response
            if not started:
                await _too_large(send, str(e.detail))


class BodyTooLarge(HTTPException):
    """FastAPI re-raises its own HTTPException while reading a body (anything else becomes a 400), so the app's
    handler answers it: 413 with an OpenAI-style body."""

    def __init__(self, message: str) -> None:
        super().__init__(413, message)


async def _too_large(send: Any, message: str) -> None:
    async def no_body() -> dict:
        return {"type": "http.disconnect"}

    await JSONResponse(error_body(message, "invalid_request_error", 413), status_code=413)({"type": "http"},
                                                                                           no_body, send)


fastapi_app.add_middleware(BodyLimit)


def _error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse(error_body(e.message, e.err_type, e.status, e.param), status_code=e.status, headers=headers)


@fastapi_app.exception_handler(ApiError)
async def _api_error(_: Request, e: ApiError) -> JSONResponse:
    return _error_response(e)


@fastapi_app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    first = e.errors()[0] if e.errors() else {}
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    return JSONResponse(error_body(f"invalid request body: {first.get('msg', e)}", "invalid_request_error", 422,
                                   param), status_code=422)


@fastapi_app.exception_handler(Exception)
async def _unexpected_error(_: Request, e: Exception) -> JSONResponse:
    """Anything no handler above knows: still an OpenAI-style body (a client's SDK parses it), logged here."""
    logger.exception("unexpected error answering a request")
    return JSONResponse(error_body(f"internal error ({type(e).__name__}); retry later", "server_error", 500), status_code=500)


@fastapi_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind, e.status_code), status_code=e.status_code)


async def _require_api_key(request: Request) -> None:
    """Route dependency: 401 unless the request carries one of the replica's API keys. FastAPI solves it
    before it validates the body's fields, so a client without a key learns nothing of the schema; a body that
    is not JSON at all is refused (422) before it, since FastAPI parses the JSON first."""
    ingress: Any = serve.get_replica_context().servable_object
    if not is_authorized(request.headers.get("authorization"), ingress.cfg.api_keys):
        raise ApiError(401, "invalid or missing API key (Authorization: Bearer <key>)", "authentication_error")


# every route that reveals or changes anything (all but /health)
_KEYED = [Depends(_require_api_key)]


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _or_raise(result: dict[str, Any]) -> dict[str, Any]:
    """An engine replica's answer, or the ApiError of the GenerateError it returned instead."""
    error = result.get("error")
    if error is not None:
        raise ApiError.from_generate_error(error)
    return result


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]
    return list(prompt)


def _usage(streams: ChoiceStreams, prompt_tokens: list[int], completion_tokens: list[int]) -> dict[str, int]:
    # each prompt is counted once (its n choices share it, as OpenAI does); the same prompt sent twice, twice
    seen: dict[int, int] = {}
    for k, (req, count) in enumerate(zip(streams.requests, prompt_tokens)):
        seen[req.get("prompt_index", k)] = count
    prompt = sum(seen.values())
    completion = sum(completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_ids(items: list[Any]) -> set[int]:
    return {lp.token_id for lp in items} | {t for lp in items for t, _ in lp.top}


def _completion_logprobs(items: list[Any], texts: dict[int, str], offset: int = 0) -> dict[str, Any]:
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(texts[lp.token_id])
    return {"tokens": [texts[lp.token_id] for lp in items], "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{texts[t]: v for t, v in lp.top} for lp in items], "text_offset": offsets}


def _chat_logprobs(items: list[Any], texts: dict[int, str]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts[token_id], "logprob": logprob, "bytes": list(texts[token_id].encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in items]}


@serve.deployment(max_ongoing_requests=1000)
@serve.ingress(fastapi_app)
class Ingress:
    """The OpenAI API and gRPC front. `engine` is the engine deployment's handle, or None with
    `colocate_ingress`: then this replica also runs the engine (an EngineReplica in this process, one
    replica per GPU) and answers Serve's engine hooks (health, routing stats, user_config, the
    controller's `apply_policy`) on its behalf."""

    def __init__(self, engine: Any, app_config: dict[str, Any], engine_factory: Any = None) -> None:
        self.cfg = BulletAppConfig(**app_config)
        fastapi_app.state.max_request_bytes = self.cfg.max_request_bytes  # BodyLimit's, checked as bodies arrive
        self.local: Any = None
        if engine is None:
            from bullet_ray.serve.engine_deployment import EngineReplica
            from bullet_ray.serve.local_handle import LocalHandle

            self.local = EngineReplica(app_config, engine_factory)
            engine = LocalHandle(self.local)
        self.engine = engine
        self._tokenizer: Any = None
        self._has_tokenizer = False
        self._logged_ignored: set[str] = set()

    # the engine's Serve hooks, answered here when the engine runs in this replica ----------------------
    def __del__(self) -> None:
        local = getattr(self, "local", None)  # None also when __init__ failed early
        if local is not None:
            local.__del__()

    def check_health(self) -> None:
        if self.local is not None:
            self.local.check_health()

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        if self.local is not None:
            self.local.reconfigure(user_config)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.local.record_routing_stats() if self.local is not None else {}

    def apply_policy(self, decision: dict[str, Any]) -> dict[str, Any]:
        return self._local_engine("apply_policy").apply_policy(decision)

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[Any]:
        """The engine's stream (for handles to a colocated deployment: hops, tests)."""
        async for out in self._local_engine("generate").generate(request):
            yield out

    def stats(self) -> dict[str, Any]:
        return self._local_engine("stats").stats()

    def _local_engine(self, method: str) -> Any:
        if self.local is None:
            raise RuntimeError(f"{method} goes to the engine deployment (BulletEngine)")
        return self.local

    async def _token_texts(self, token_ids: set[int]) -> dict[int, str]:
        """Text of each token id, for logprobs; the tokenizer is fetched once from an engine replica."""
        if not self._has_tokenizer:
            self._tokenizer = await self.engine.get_tokenizer.remote()
            self._has_tokenizer = True
        if self._tokenizer is None:  # an engine without a tokenizer (the mock): the ids as text
            return {t: str(t) for t in token_ids}
        return {t: self._tokenizer.decode([t]) for t in token_ids}

    # checks -----------------------------------------------------------------------------------------
    def _check_body(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """The model name (404), then features this server does not implement (400 naming the field). The key was
        checked by _require_api_key, the body's size by BodyLimit as it arrived."""
        self._check_model(body.model)
        try:
            body.check_supported()
        except UnsupportedParameter as e:
            raise ApiError(400, str(e), "invalid_request_error", e.param) from e
        ignored = set(body.ignored_fields()) - self._logged_ignored
        if ignored:  # names only, never values; once per field and replica
            self._logged_ignored |= ignored
            logger.warning("accepted and ignored request fields: %s", ", ".join(sorted(ignored)))

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.cfg.model_name:
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.cfg.model_name!r}",
                           "not_found_error", "model")

    def _params(self, body: CompletionRequest | ChatCompletionRequest, choice: int) -> SamplingParams:
        fields = body.sampling_fields()
        if body.seed is not None:
            fields["seed"] = body.seed + choice
        try:
            return SamplingParams.from_openai(fields, self.cfg.default_max_tokens)
        except InvalidSamplingParams as e:
            raise ApiError(400, str(e), "invalid_request_error", e.field) from e

    # routes -----------------------------------------------------------------------------------------
    @fastapi_app.get("/health")
    async def health(self) -> dict[str, str]:
        return {"status": "ok"}

    @fastapi_app.get("/openapi.json", include_in_schema=False, dependencies=_KEYED)
    async def openapi_spec(self, request: Request) -> dict[str, Any]:
        return request.app.openapi()

    @fastapi_app.get("/v1/models", dependencies=_KEYED)
    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "bullet_ray"}]}

    @fastapi_app.get("/v1/internal/stats", dependencies=_KEYED)
    async def engine_stats(self) -> dict[str, Any]:
        """One engine replica's load (KV blocks, waiting/running); for tests and operators."""
        return await engine_answer(self.engine.stats.remote(), self.cfg.retry_after_s)

    @fastapi_app.post("/v1/completions", dependencies=_KEYED)
    async def completions(self, body: CompletionRequest) -> Any:
        self._check_body(body)
        prompts = _prompt_list(body.prompt)
        reqs = [{"prompt": p, "params": self._params(body, i), "request_id": uuid.uuid4().hex, "prompt_index": j}
                for j, p in enumerate(prompts) for i in range(body.n)]
        return await self._respond(body, reqs, chat=False)

    @fastapi_app.post("/v1/chat/completions", dependencies=_KEYED)
    async def chat_completions(self, body: ChatCompletionRequest) -> Any:
        self._check_body(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        reqs = [{"messages": messages, "params": self._params(body, i), "request_id": uuid.uuid4().hex,
                 "prompt_index": 0} for i in range(body.n)]
        return await self._respond(body, reqs, chat=True)

    @fastapi_app.post("/tokenize", dependencies=_KEYED)
    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's: the token ids the engine would run for a prompt or chat messages, their count, the context."""
        self._check_model(body.model)
        try:
            request = body.engine_request()
        except UnsupportedParameter as e:
            raise ApiError(400, str(e), "invalid_request_error", e.param) from e
        return _or_raise(await engine_answer(self.engine.tokenize.remote(request), self.cfg.retry_after_s))

    @fastapi_app.post("/detokenize", dependencies=_KEYED)
    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's: the text of token ids."""
        self._check_model(body.model)
        return _or_raise(await engine_answer(self.engine.detokenize.remote(body.tokens), self.cfg.retry_after_s))

    # gRPC: Serve's gRPC proxy calls the method named after the RPC ---------------------------------
    async def Generate(self, request: Any, grpc_context: Any = None) -> AsyncIterator[Any]:
        """bullet_ray.Generator/Generate (bullet_ray/serve/proto/generate.proto), server streaming."""
        if not self.cfg.grpc_enabled:
            if grpc_context is not None:
                grpc_context.set_code(grpc.StatusCode.UNIMPLEMENTED)
                grpc_context.set_details("gRPC is off for this application (grpc_enabled: false)")
            raise ApiError(501, "gRPC is off for this application (grpc_enabled: false)")
        async for response in generate_stream(self.engine, self.cfg, request, grpc_context):
            yield response

    # responses --------------------------------------------------------------------------------------
    async def _respond(self, body: Any, reqs: list[dict[str, Any]], chat: bool) -> Any:
        streams = ChoiceStreams(self.engine, reqs, self.cfg.retry_after_s)
        await streams.start()
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse_stream(streams, rid, chat, include_usage),
                                     media_type="text/event-stream")
        try:
            return await self._collect(streams, rid, chat)
        finally:
            streams.cancel()

    async def _collect(self, streams: ChoiceStreams, rid: str, chat: bool) -> dict[str, Any]:
        n = len(streams.requests)
        texts = [""] * n
        finish: list[str | None] = [None] * n
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        prompt_tokens = [0] * n
        completion_tokens = [0] * n
        try:
            async for i, out in streams.merged():
                texts[i] += out.text_delta
                logprobs[i] += out.logprobs_delta or []
                prompt_tokens[i], completion_tokens[i] = out.num_prompt_tokens, out.num_output_tokens
                if out.finished:
                    finish[i] = out.finish_reason
        except ApiError:
            raise
        if "error" in finish:  # the engine died under the request: no partial answer as a success
            raise ApiError(503, "the engine failed while generating this request; retry later", "server_error",
                           retry_after_s=streams.retry_after_s)
        choices = []
        token_texts = (await self._token_texts(set().union(*(_token_ids(items) for items in logprobs)))
                       if any(logprobs) else {})
        for i in range(n):
            wants_logprobs = streams.requests[i]["params"].logprobs is not None
            if chat:
                choice: dict[str, Any] = {
                    "index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": finish[i],
                    "logprobs": _chat_logprobs(logprobs[i], token_texts) if wants_logprobs else None}
            else:
                choice = {"index": i, "text": texts[i], "finish_reason": finish[i],
                          "logprobs": _completion_logprobs(logprobs[i], token_texts) if wants_logprobs else None}
            choices.append(choice)
        usage = _usage(streams, prompt_tokens, completion_tokens)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.cfg.model_name, "choices": choices, "usage": usage}

    async def _sse_stream(self, streams: ChoiceStreams, rid: str, chat: bool,
                          include_usage: bool) -> AsyncIterator[str]:
        n = len(streams.requests)
        prompt_tokens, completion_tokens = [0] * n, [0] * n
        text_offsets = [0] * n
        # logprobs of updates without text (half a character, text held back as a possible stop string's start):
        # they go out with the choice's next chunk, so every token's logprob reaches the client
        held: list[list[Any]] = [[] for _ in range(n)]
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": self.cfg.model_name}
        try:
            if chat:
                for i in range(n):
                    yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None, "logprobs": None}]})
            async for i, out in streams.merged():
                prompt_tokens[i], completion_tokens[i] = out.num_prompt_tokens, out.num_output_tokens
                wants_logprobs = streams.requests[i]["params"].logprobs is not None
                if not out.text_delta and not out.finished:
                    if wants_logprobs:
                        held[i] += out.logprobs_delta or []
                    continue
                lp = held[i] + (out.logprobs_delta or []) if wants_logprobs else None
                held[i] = []
                token_texts = await self._token_texts(_token_ids(lp)) if lp else {}
                if chat:
                    choice: dict[str, Any] = {"index": i, "delta": {"content": out.text_delta} if out.text_delta else {},
                                              "finish_reason": out.finish_reason,
                                              "logprobs": _chat_logprobs(lp, token_texts) if lp else None}
                else:
                    choice = {"index": i, "text": out.text_delta, "finish_reason": out.finish_reason,
                              "logprobs": _completion_logprobs(lp, token_texts, text_offsets[i]) if lp else None}
                text_offsets[i] += len(out.text_delta)
                yield _sse({**base, "choices": [choice]})
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(streams, prompt_tokens, completion_tokens)})
            yield _sse("[DONE]")
        except ApiError as e:
            yield _sse(error_body(e.message, e.err_type, e.status, e.param))
            yield _sse("[DONE]")
        finally:
            streams.cancel()  # a disconnected client lands here too: abort what still runs
