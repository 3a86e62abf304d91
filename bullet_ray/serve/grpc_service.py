"""The gRPC `Generate` call (bullet_ray/serve/proto/generate.proto) as served by the ingress deployment.

Ray Serve's gRPC proxy calls the ingress replica's method named after the RPC (`Generate`) with the
decoded request; it yields `GenerateResponse` messages. Refusals map to gRPC status codes the way the
HTTP API maps them to 4xx: INVALID_ARGUMENT (400/413/422), NOT_FOUND (unknown model), UNAUTHENTICATED
(bad API key) and RESOURCE_EXHAUSTED (saturated, with a `retry-after` trailer).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc

from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidSamplingParams
from bullet_ray.serve.auth import is_authorized
from bullet_ray.serve.config import BulletAppConfig
from bullet_ray.serve.proto.generate_pb2 import GenerateRequest, GenerateResponse, Usage
from bullet_ray.serve.streams import ApiError, ChoiceStreams

_STATUS_BY_HTTP = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
                   404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
                   422: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                   503: grpc.StatusCode.UNAVAILABLE}


def grpc_status(http_status: int) -> grpc.StatusCode:
    """The gRPC status that stands for an HTTP error status of the OpenAI API."""
    return _STATUS_BY_HTTP.get(http_status, grpc.StatusCode.INTERNAL)


def engine_request(message: GenerateRequest, cfg: BulletAppConfig) -> dict[str, Any]:
    """The engine request (as EngineReplica.generate takes it) a GenerateRequest stands for; raises ApiError."""
    if message.model and message.model != cfg.model_name:
        raise ApiError(404, f"model {message.model!r} does not exist; this server serves {cfg.model_name!r}",
                       "not_found_error", "model")
    has_text, has_ids = bool(message.prompt), bool(message.prompt_token_ids)
    if has_text == has_ids:
        raise ApiError(400, "give exactly one of prompt and prompt_token_ids", param="prompt")
    if any(t < 0 for t in message.prompt_token_ids):
        raise ApiError(400, "prompt_token_ids must be >= 0", param="prompt_token_ids")
    if message.chat and not has_text:
        raise ApiError(400, "chat=true needs the user message in prompt", param="prompt")
    fields: dict[str, Any] = {"stop": list(message.stop), "ignore_eos": message.ignore_eos}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        if message.HasField(name):
            fields[name] = getattr(message, name)
    try:
        params = SamplingParams.from_openai(fields, cfg.default_max_tokens)
    except InvalidSamplingParams as e:
        raise ApiError(400, str(e), param=e.field) from e
    request: dict[str, Any] = {"params": params, "request_id": uuid.uuid4().hex}
    if message.chat:
        request["messages"] = [{"role": "user", "content": message.prompt}]
    else:
        request["prompt"] = message.prompt if has_text else list(message.prompt_token_ids)
    return request


def check_api_key(metadata: list[tuple[str, str]], cfg: BulletAppConfig) -> None:
    """Raise ApiError(401) unless the call carries `authorization: Bearer <key>` (when keys are configured)."""
    auth = next((value for key, value in metadata if key.lower() == "authorization"), None)
    if not is_authorized(auth if isinstance(auth, str) else None, cfg.api_keys):
        raise ApiError(401, "invalid or missing API key (metadata authorization: Bearer <key>)",
                       "authentication_error")


def _refuse(grpc_context: Any, e: ApiError) -> None:
    if grpc_context is None:
        return
    grpc_context.set_code(grpc_status(e.status))
    grpc_context.set_details(e.message)
    if e.retry_after_s:
        grpc_context.set_trailing_metadata([("retry-after", str(e.retry_after_s))])


async def generate_stream(engine: Any, cfg: BulletAppConfig, message: GenerateRequest,
                          grpc_context: Any) -> AsyncIterator[GenerateResponse]:
    """Stream one Generate call; on refusal set the gRPC status on `grpc_context` and raise ApiError."""
    streams: ChoiceStreams | None = None
    try:
        check_api_key(list(grpc_context.invocation_metadata()) if grpc_context is not None else [], cfg)
        streams = ChoiceStreams(engine, [engine_request(message, cfg)], cfg.retry_after_s)
        await streams.start()
        async for _, out in streams.merged():
            if not out.token_ids_delta and not out.finished:
                continue
            response = GenerateResponse(text=out.text_delta, token_ids=out.token_ids_delta,
                                        finish_reason=out.finish_reason or "")
            if out.finished:
                response.usage.CopyFrom(Usage(prompt_tokens=out.num_prompt_tokens,
                                              completion_tokens=out.num_output_tokens,
                                              total_tokens=out.num_prompt_tokens + out.num_output_tokens))
            yield response
    except ApiError as e:
        _refuse(grpc_context, e)
        raise
    finally:
        if streams is not None:
            streams.cancel()  # the client went away (or the call ended): abort what still runs
