"""The engine front's view of each request: where it is, what was streamed, and who is listening."""

from __future__ import annotations

import asyncio
import queue
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from bullet_ray.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from bullet_ray.engine.sampling_params import SamplingParams

# where a live request is: queued or prefilling in the prefill worker, decoding in the decode worker,
# or anywhere in the single worker of the chunked schedule
Location = Literal["prefill", "decode", "hybrid"]


class OutputSink:
    """Delivers a request's outputs to a synchronous or an asyncio consumer, from the receiver thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.loop = loop
        self.sync_queue: queue.Queue[RequestOutput] | None = None if loop else queue.Queue()
        self.async_queue: asyncio.Queue[RequestOutput] | None = asyncio.Queue() if loop else None

    def put(self, output: RequestOutput) -> None:
        if self.loop is not None:
            assert self.async_queue is not None
            self.loop.call_soon_threadsafe(self.async_queue.put_nowait, output)
        else:
            assert self.sync_queue is not None
            self.sync_queue.put(output)


@dataclass
class RequestState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    sink: OutputSink
    detokenizer: Any  # IncrementalDetokenizer (over TokenIdText for a model without a tokenizer)
    location: Location
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    num_output_tokens: int = 0

    def make_output(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None,
                    finish_reason: FinishReason | None = None, stop_reason: str | int | None = None,
                    error: str | None = None) -> RequestOutput:
        now = time.monotonic()
        if token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.num_output_tokens += len(token_ids)
        ttft = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        return RequestOutput(
            request_id=self.request_id, token_ids_delta=token_ids, text_delta=text,
            logprobs_delta=logprobs if self.params.logprobs is not None else None,
            num_prompt_tokens=len(self.prompt_token_ids), num_output_tokens=self.num_output_tokens,
            finished=finish_reason is not None, finish_reason=finish_reason, stop_reason=stop_reason,
            error=error, ttft_s=ttft, e2e_s=(now - self.arrival_s) if finish_reason else None,
        )
