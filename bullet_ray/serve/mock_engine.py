"""A model-free engine that implements the real EngineClient protocol, for fast Serve-layer tests.

Output token i of a request is (prompt_len + i) % 1000; its text is " t<id>". Every running request
holds one fake KV block, so tests can check that disconnects free blocks. `token_delay_s` paces the
stream; `first_token_delay_s` keeps requests "waiting" (no first token) for a while.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from bullet_ray.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from bullet_ray.engine.protocol import EngineClient, Prompt
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.errors import InvalidRequest


class MockEngine(EngineClient):
    def __init__(self, model_name: str = "mock", max_model_len: int = 4096, num_kv_blocks: int = 1024,
                 token_delay_s: float = 0.0, first_token_delay_s: float = 0.0, on_request: Any = None) -> None:
        self._model_name = model_name
        self._max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.token_delay_s = token_delay_s
        self.first_token_delay_s = first_token_delay_s
        self.on_request = on_request
        self._lock = threading.Lock()
        self._waiting: set[str] = set()
        self._running: set[str] = set()

    @property
    def tokenizer(self) -> Any:
        return None

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _ids(self, prompt: Prompt) -> list[int]:
        ids = list(range(len(prompt.split()))) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        return ids

    async def stream_async(self, prompt: Prompt, params: SamplingParams,
                           request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        ids = self._ids(prompt)
        if len(ids) + params.max_tokens > self._max_model_len:
            raise InvalidRequest("prompt + max_tokens exceeds the maximum context length", "max_tokens",
                                 code="context_length_exceeded")
        rid = request_id or uuid.uuid4().hex
        if self.on_request is not None:
            self.on_request(rid)
        with self._lock:
            self._waiting.add(rid)
        finished = False
        try:
            await asyncio.sleep(self.first_token_delay_s)
            with self._lock:
                self._waiting.discard(rid)
                self._running.add(rid)
            for i in range(params.max_tokens):
                token = (len(ids) + i) % 1000
                finished = i == params.max_tokens - 1
                yield RequestOutput(rid, [token], f" t{token}", None, len(ids), i + 1, finished,
                                    "length" if finished else None)
                if not finished:
                    await asyncio.sleep(self.token_delay_s)
        finally:
            with self._lock:
                self._waiting.discard(rid)
                self._running.discard(rid)

    def stream(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> Iterator[RequestOutput]:
        raise NotImplementedError("the mock engine streams only asynchronously")

    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        raise NotImplementedError("the mock engine streams only asynchronously")

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._waiting.discard(request_id)
            self._running.discard(request_id)

    def stats(self) -> EngineStats:
        with self._lock:
            waiting, running = len(self._waiting), len(self._running)
        return EngineStats(waiting, running, self.num_kv_blocks, self.num_kv_blocks - waiting - running)

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None


def mock_engine_factory(**kwargs: Any) -> Any:
    """A factory for build_app(engine_factory=...) making MockEngines with these settings."""

    def make(app_config: Any) -> MockEngine:
        return MockEngine(model_name=app_config.model_name, **kwargs)

    return make


