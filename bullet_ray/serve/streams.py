"""Fan-out of one API request into engine streams (prompts x n choices) and their merge.

Every choice is one engine request. The first item of every stream is fetched before the HTTP response
starts, so a request the engines refuse (bad parameters, too long, saturated) gets a proper HTTP error
instead of a broken 200 stream; the first choice refused answers at once (with n > 1 it does not wait for
the other choices' first tokens) and cancels the others. Closing a `ChoiceStreams` cancels every engine
request it started, which aborts them in the engine and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

from bullet_ray.engine.outputs import RequestOutput
from bullet_ray.serve.engine_deployment import GenerateError


class ApiError(Exception):
    """An error the ingress answers with an OpenAI-style body."""

    def __init__(self, status: int, message: str, err_type: str = "invalid_request_error",
                 param: str | None = None, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray (the gRPC path raises it through Serve)
        return (ApiError, (self.status, self.message, self.err_type, self.param, self.retry_after_s))

    @classmethod
    def from_generate_error(cls, e: GenerateError) -> ApiError:
        return cls(e.status, e.message, e.err_type, e.param, e.retry_after_s)


def replica_lost(e: BaseException, retry_after_s: int) -> ApiError:
    """The error a client gets when its engine replica died under it (503: Serve is replacing it)."""
    return ApiError(503, f"engine replica unavailable ({type(e).__name__}); retry later", "server_error",
                    retry_after_s=retry_after_s)


def engines_saturated(e: BaseException, retry_after_s: int) -> ApiError:
    """The error a client gets when Serve refuses its request because every engine replica's queue is full (429)."""
    return ApiError(429, f"every engine is saturated; retry later ({e})", "rate_limit_error",
                    retry_after_s=retry_after_s)


async def engine_answer(response: Any, retry_after_s: int) -> Any:
    """The awaited answer of a (non-streaming) engine replica call, its Ray failures as the API's errors: 429 when
    every replica is saturated, 503 when none is up or the one called died."""
    try:
        return await response
    except BackPressureError as e:
        raise engines_saturated(e, retry_after_s) from e
    except (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError) as e:
        raise replica_lost(e, retry_after_s) from e


class ChoiceStreams:
    def __init__(self, engine: Any, requests: list[dict[str, Any]], retry_after_s: int) -> None:
        self.engine = engine
        self.requests = requests
        self.retry_after_s = retry_after_s
        self.gens: list[Any] = []
        self.firsts: list[RequestOutput] = []

    async def start(self) -> None:
        """Start every choice and wait for its first item; raise ApiError as soon as any choice is refused (an
        error item, Serve's back-pressure, a lost replica), without waiting for the others' first items, which
        are cancelled with every engine request (no KV block or request is left behind)."""
        firsts: list[asyncio.Future[Any]] = []
        try:
            for req in self.requests:
                self.gens.append(self.engine.options(stream=True).generate.remote(req))
            firsts = [asyncio.ensure_future(g.__anext__()) for g in self.gens]
            pending = set(firsts)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for first in (f for f in firsts if f in done):  # in choice order when several are done
                    item = first.result()  # raises the choice's exception
                    if isinstance(item, GenerateError):
                        raise ApiError.from_generate_error(item)
        except BackPressureError as e:
            self._cancel_starting(firsts)
            raise engines_saturated(e, self.retry_after_s) from e
        except (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError) as e:
            # the replica died (killed, or replaced after a crash) before answering, or none is up to route to
            self._cancel_starting(firsts)
            raise replica_lost(e, self.retry_after_s) from e
        except BaseException:  # a refusal (ApiError), or this request cancelled (the client went away)
            self._cancel_starting(firsts)
            raise
        self.firsts = [f.result() for f in firsts]

    async def merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) in arrival order across choices, until every choice finished; a refusal or
        a failed replica mid-stream raises ApiError. One choice (the usual request) is read straight from its
        stream; several are read by one task each into a shared queue."""
        if len(self.gens) == 1:
            async for item in self._choice(0):
                yield 0, item
            return
        queue: asyncio.Queue[tuple[int, RequestOutput | ApiError]] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async for item in self._choice(index):
                    await queue.put((index, item))
            except ApiError as e:
                await queue.put((index, e))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.gens))]
        remaining = len(tasks)
        try:
            while remaining:
                index, got = await queue.get()
                if isinstance(got, ApiError):
                    raise got
                if got.finished:
                    remaining -= 1
                yield index, got
        finally:
            for t in tasks:
                t.cancel()

    async def _choice(self, index: int) -> AsyncIterator[RequestOutput]:
        """One choice's outputs, its first (fetched by start) to its finished one."""
        first = self.firsts[index]
        yield first
        if first.finished:
            return
        stream = self.gens[index]
        while True:
            try:
                item = await stream.__anext__()
            except StopAsyncIteration:  # ended without its finished output: its replica went away
                raise replica_lost(RuntimeError("the stream ended before its last output"),
                                   self.retry_after_s) from None
            except ApiError:
                raise
            except Exception as e:  # the replica failed mid-stream: end this choice with an error
                raise replica_lost(e, self.retry_after_s) from e
            if isinstance(item, GenerateError):
                raise ApiError.from_generate_error(item)
            yield item
            if item.finished:
                return

    def cancel(self) -> None:
        for g in self.gens:
            g.cancel()

    def _cancel_starting(self, firsts: list[asyncio.Future[Any]]) -> None:
        """start() failed: stop the first-item fetches still waiting (a local stream's cancelled fetch closes its
        generator, which aborts its request), then every stream. Outcomes nobody reads are fetched here, so a
        second refusal is not logged as an exception never retrieved."""
        for first in firsts:
            first.cancel()
            first.add_done_callback(lambda f: f.cancelled() or f.exception())
        self.cancel()
