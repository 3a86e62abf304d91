"""The part of a Serve DeploymentHandle the ingress uses, over an engine replica in the same process.

With `colocate_ingress` the ingress routes and the engine front run in one replica per GPU, so a
token goes from the engine front to the HTTP response without crossing a Ray actor boundary (each
crossing costs a serialization, a report to the caller and two thread hops per streamed item). The
ingress code stays the same: `engine.options(stream=True).generate.remote(req)` returns a
`LocalStream` that iterates the replica's async generator, `engine.stats.remote()` an awaitable.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable
from typing import Any


class LocalHandle:
    """`handle.options(...).method.remote(*args)` on a local object (options are ignored)."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def options(self, **_: Any) -> LocalHandle:
        return self

    def __getattr__(self, name: str) -> _LocalMethod:
        return _LocalMethod(getattr(self._target, name))


class _LocalMethod:
    def __init__(self, fn: Any) -> None:
        self._fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self._fn(*args, **kwargs)
        if inspect.isasyncgen(result):
            return LocalStream(result)
        if inspect.isawaitable(result):
            return result
        return _value(result)


async def _value(value: Any) -> Any:
    """A plain return value as an awaitable, as a handle's response is."""
    return value


class LocalStream:
    """A streaming response over a local async generator: iterate it, or `cancel()` it (closes the
    generator, which aborts the engine request and frees its KV blocks)."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self._gen = gen
        self._closing: asyncio.Task[None] | None = None

    def __aiter__(self) -> LocalStream:
        return self

    def __anext__(self) -> Awaitable[Any]:
        return self._gen.__anext__()

    def cancel(self) -> None:
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())

    async def _close(self) -> None:
        try:
            await self._gen.aclose()  # type: ignore[attr-defined]
        except RuntimeError:
            pass  # a task is still inside the generator: cancelling that task closes it
