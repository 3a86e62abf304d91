"""The engine's public protocol: what the Serve layer (and any other front end) may call.

`LLMEngine` implements it over real workers; `bullet_ray.serve.mock_engine.MockEngine` implements it
without a model for fast Serve-layer tests. Keep the two in step.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Iterator
from typing import Any

from bullet_ray.engine.outputs import CompletionOutput, EngineStats, RequestOutput
from bullet_ray.engine.sampling_params import SamplingParams

Prompt = str | list[int]


class EngineClient(abc.ABC):
    """Submit prompts, stream their outputs, abort them, read load statistics.

    Rules:
    - A prompt is text (tokenized by the engine, no chat template applied) or a list of token ids.
    - Errors in the request itself (empty prompt, prompt + max_tokens over max_model_len, a token id
      outside the vocabulary) raise `InvalidRequest` from the stream before any output.
    - Every stream ends with exactly one output whose `finished` is True (finish_reason "abort" when
      aborted, "error" with `error` set when a worker failed on it).
    - Leaving an async stream early (break, cancellation, client disconnect) aborts the request and
      frees its KV blocks.
    """

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (with chat template) of the served model, or None."""

    @property
    @abc.abstractmethod
    def model_name(self) -> str:
        """The name the model is served under."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + output in tokens."""

    @abc.abstractmethod
    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The token ids the engine would run for `prompt` (text through its tokenizer); `InvalidRequest`
        where `stream` would raise it for the prompt alone (empty, an id outside the vocabulary)."""

    @abc.abstractmethod
    def stream(self, prompt: Prompt, params: SamplingParams,
               request_id: str | None = None) -> Iterator[RequestOutput]:
        """Submit and iterate the outputs synchronously."""

    @abc.abstractmethod
    def stream_async(self, prompt: Prompt, params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Submit and iterate the outputs in asyncio; closing the iterator aborts the request."""

    @abc.abstractmethod
    def generate(self, prompts: list[Prompt], params: SamplingParams | list[SamplingParams],
                 use_tqdm: bool = False) -> list[CompletionOutput]:
        """Run a batch of prompts to completion (blocking); results in prompt order."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; a no-op for unknown or finished ids."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Current load: waiting/running requests, KV blocks, predicted TTFT."""

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise EngineDeadError when a worker has died."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release shared memory. Idempotent."""
