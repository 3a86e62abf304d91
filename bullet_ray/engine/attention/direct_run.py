"""A flashinfer wrapper's `run` for every layer of one plan at the cost of one call into its compiled module.

A step calls attention once per layer (twice in a mixed step: decode rows and prompt chunks), each time
through the wrapper's public `run`, which validates its inputs, unpacks the cache and assembles the same
argument list for its compiled module on every call. In piecewise-graph steps on the H100 that Python took
~5 ms of a ~12 ms host launch (`attention_ms` in the step log), which the GPU waits for in small mixed steps.

`DirectRun` sends the first layer after a plan through the public `run`, with the wrapper's module swapped
for a recorder that notes the entry point and the arguments it is handed; the other layers call that entry
point with the recorded list, their own q, K cache, V cache and output put where the first layer's were.
(A ragged wrapper, `ragged=True`, takes K and V rows instead of the cache pair: the same record, by the same rule.)
The positions are found by identity: each of the four must appear exactly once, the recorder must have seen
exactly one call (with positional arguments only) and `run` must return the given output, else that wrapper
keeps the public `run`. The record holds only what `run` derived from its plan and from values every layer
shares: under one plan every layer's q, K, V and output have the same shapes, dtypes and device (our caller's
case), and no other argument may depend on the tensors themselves (flashinfer 0.7.2 derives the page size,
alibi slopes and default scale from their shapes only). A plan makes the record stale: `PlanFence` counts each
wrapper's plans and a record is used only under the plan it was taken in. Callers pass no scales, sinks or
log-sum-exp (what `run` would apply after the module's call). The record drops the four tensors after each
call, so it keeps no layer's activations alive.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class _Recorder:
    """Stands in for a wrapper's compiled module during one `run`: notes each call made through it."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.calls: list[tuple[Callable[..., Any], list[Any]]] = []

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._module, name)
        if not callable(target):
            return target

        def record(*args: Any, **kwargs: Any) -> Any:
            # a keyword argument makes the call unrecordable (the record replays positions only)
            self.calls.append((target, list(args)) if not kwargs else (target, []))
            return target(*args, **kwargs)

        return record


def _positions(args: list[Any], items: tuple[Any, ...]) -> tuple[int, ...] | None:
    """Where each of `items` sits in `args` (by identity), when each appears exactly once."""
    found = []
    for item in items:
        hits = [i for i, a in enumerate(args) if a is item]
        if len(hits) != 1:
            return None
        found.append(hits[0])
    return tuple(found) if len(set(found)) == len(found) else None


class DirectRun:
    """Runs one flashinfer wrapper's planned attention (see the module docstring)."""

    def __init__(self, wrapper: Any, plan_count: Callable[[], int], enable_pdl: bool | None = None,
                 ragged: bool = False) -> None:
        self.wrapper = wrapper
        # a ragged wrapper's run takes K and V themselves (the step's own rows), a paged one the pool's pair
        self.ragged = ragged
        self._plan_count = plan_count  # the wrapper's plans so far (PlanFence)
        self.enable_pdl = enable_pdl
        self.usable = True  # False once a record failed: every layer then takes the public run
        self._record: tuple[int, Callable[..., Any], list[Any], tuple[int, ...]] | None = None
        self.direct_calls = 0  # layers that skipped the public run (tests, logs)

    def _public_run(self, q: Any, k_cache: Any, v_cache: Any, out: Any) -> Any:
        if self.ragged:
            return self.wrapper.run(q, k_cache, v_cache, out=out, enable_pdl=self.enable_pdl)
        return self.wrapper.run(q, (k_cache, v_cache), out=out, enable_pdl=self.enable_pdl)

    def run(self, q: Any, k_cache: Any, v_cache: Any, out: Any) -> Any:
        """Attention of q over the (k_cache, v_cache) pair (a ragged wrapper: over K and V rows) under the
        wrapper's current plan, into `out`."""
        record = self._record
        if record is not None and record[0] == self._plan_count():
            _, entry, args, (iq, ik, iv, io) = record
            args[iq], args[ik], args[iv], args[io] = q, k_cache, v_cache, out
            try:
                entry(*args)
            finally:  # the record must not keep a layer's tensors (q holds the whole fused q/k/v) alive
                args[iq] = args[ik] = args[iv] = args[io] = None
            self.direct_calls += 1
            return out
        module = getattr(self.wrapper, "_cached_module", None)
        if not self.usable or module is None:
            return self._public_run(q, k_cache, v_cache, out)
        recorder = _Recorder(module)
        self.wrapper._cached_module = recorder
        try:
            result = self._public_run(q, k_cache, v_cache, out)
        finally:
            self.wrapper._cached_module = module
        self._record = None
        if len(recorder.calls) == 1 and result is out:
            entry, args = recorder.calls[0]
            positions = _positions(args, (q, k_cache, v_cache, out))
            if positions is not None:
                for i in positions:
                    args[i] = None
                self._record = (self._plan_count(), entry, args, positions)
        if self._record is None:
            self.usable = False
            logger.warning("flashinfer %s: its run does not hand q, K, V and out to one module call; every "
                           "layer takes the public run", type(self.wrapper).__name__)
        return result
