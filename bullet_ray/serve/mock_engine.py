"""A model-free engine that implements the real EngineClient protocol, for fast Serve-layer tests.

Deterministic: output token i of a request is (num_prompt_tokens + i) % 1000 and its text is " t<id>".
Text prompts are split on whitespace (one token per word) unless a real tokenizer is passed in, in
which case it tokenizes prompts and its chat template serves /v1/chat/completions. KV blocks are
accounted like the real engine's: a request holds ceil((prompt + generated tokens) / block_size)
blocks from admission until it finishes or is aborted, so tests can check that a disconnect frees
every block. Knobs: `token_delay_s` paces the stream, `first_token_delay_s` keeps requests waiting
(no first token) for a while, `predicted_ttft_s` is what `stats()` reports (set it to saturate the
engine for admission tests).
"""

from __future__ import annotations

import asyncio
import math
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from bullet_ray.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from bullet_ray.engine.protocol import EngineClient, Prompt
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidRequest


@dataclass
class _MockRequest:
    num_prompt_tokens: int
    num_blocks: int = 0
    is_running: bool = False
    is_aborted: bool = False


class MockEngine(EngineClient):
    """See the module docstring. Thread-safe; streams run on the caller's event loop."""

    def __init__(self, model_name: str = "mock", max_model_len: int = 4096, num_kv_blocks: int = 1024,
                 block_size: int = 16, token_delay_s: float = 0.0, first_token_delay_s: float = 0.0,
                 predicted_ttft_s: float | None = None, tokenizer: Any = None, on_request: Any = None) -> None:
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.predicted_ttft_s = predicted_ttft_s
        self.on_request = on_request
        self.num_requests_total = 0
        self._lock = threading.Lock()
        self._requests: dict[str, _MockRequest] = {}
        self._num_free_blocks = num_kv_blocks

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids as this engine counts them (one per word without a tokenizer); InvalidRequest
        for an empty prompt, as the real engine."""
        if isinstance(prompt, str):
            ids = list(self._tokenizer.encode(prompt)) if self._tokenizer is not None \
                else list(range(len(prompt.split())))
        else:
            ids = list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        return ids

    # KV accounting -------------------------------------------------------------------------------
    def _grow(self, req: _MockRequest, num_tokens: int) -> bool:
        """Hold enough blocks for num_tokens; False (holding what it had) when the pool is empty."""
        need = math.ceil(num_tokens / self.block_size) - req.num_blocks
        with self._lock:
            if need > self._num_free_blocks:
                return False
            self._num_free_blocks -= max(need, 0)
            req.num_blocks += max(need, 0)
        return True

    def _release(self, rid: str) -> None:
        with self._lock:
            req = self._requests.pop(rid, None)
            if req is not None:
                self._num_free_blocks += req.num_blocks

    # EngineClient ---------------------------------------------------------------------------------
    async def stream_async(self, prompt: Prompt, params: SamplingParams,
                           request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        ids = self.prompt_ids(prompt)
        params = params.fitted_to_context(len(ids), self._max_model_len)
        if len(ids) + params.max_tokens > self._max_model_len:
            raise InvalidRequest(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"maximum context length {self._max_model_len}", "max_tokens",
                                 code="context_length_exceeded")
        rid = request_id or uuid.uuid4().hex
        if self.on_request is not None:
            self.on_request(rid)
        req = _MockRequest(len(ids))
        with self._lock:
            self._requests[rid] = req
            self.num_requests_total += 1
        try:
            while not self._grow(req, len(ids)):  # the prompt's blocks, held from admission
                await asyncio.sleep(0.01)
            await asyncio.sleep(self.first_token_delay_s)
            req.is_running = True
            for i in range(params.max_tokens):
                if req.is_aborted:
                    yield RequestOutput(rid, [], "", None, len(ids), i, True, "abort")
                    return
                while not self._grow(req, len(ids) + i + 1):  # wait for blocks, as a preempted request would
                    await asyncio.sleep(0.01)
                token = (len(ids) + i) % 1000
                finished = i == params.max_tokens - 1
                yield RequestOutput(rid, [token], f" t{token}", None, len(ids), i + 1, finished,
                                    "length" if finished else None)
                if not finished:
                    await asyncio.sleep(self.token_delay_s)
        finally:
            self._release(rid)

    def stream(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Iterator[RequestOutput]:
        async def collect() -> list[RequestOutput]:
            return [out async for out in self.stream_async(prompt, params, request_id)]

        yield from asyncio.run(collect())

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        results = []
        for prompt, p in zip(prompts, per_prompt):
            outs = list(self.stream(prompt, p))
            token_ids = [t for o in outs for t in o.token_ids_delta]
            results.append(CompletionOutput(outs[-1].request_id, self.prompt_ids(prompt), token_ids,
                                            "".join(o.text_delta for o in outs), outs[-1].finish_reason or "length"))
        return results

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None:
                req.is_aborted = True

    def stats(self) -> EngineStats:
        with self._lock:
            running = sum(1 for r in self._requests.values() if r.is_running)
            waiting = len(self._requests) - running
            free = self._num_free_blocks
        return EngineStats(waiting, running, self.num_kv_blocks, free, predicted_ttft_s=self.predicted_ttft_s)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def mock_engine_factory(**kwargs: Any) -> Any:
    """A factory for `bullet_ray.serve.app.build_app(args, engine_factory=...)` making MockEngines."""

    def make(app_config: Any) -> MockEngine:
        return MockEngine(model_name=app_config.model_name, **kwargs)

    return make
