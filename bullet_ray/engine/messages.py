"""Messages between the engine front and its workers (pickled over one Unix-socket connection each).

Engine -> worker: AddRequest, AbortRequests, Shutdown, Wake.
Worker -> engine: Ready (once), StepOutputs (once per step that produced anything), AbortMissed,
WorkerFailed. A prefill worker's StepOutputs carry the sequences it finished prefilling (`handoffs`);
the engine relays each to the decode worker as a `Handoff`. A decode worker's StepOutputs carry
sequences it preempted (blocks already freed); the engine sends them back to prefill for recompute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bullet_ray.engine.outputs import FinishReason, TokenLogprob
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.sequence import SequenceWire


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float
    max_model_len: int
    # a preempted sequence coming back for recompute (its output so far and RNG state); None for new ones
    resume: SequenceWire | None = None


@dataclass(frozen=True)
class Handoff:
    """A prefilled sequence (KV in the pool, first token sampled) for the decode worker."""

    seq: SequenceWire


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look at the shared state block now (e.g. a new SM split was requested)."""


@dataclass(frozen=True)
class TokenUpdate:
    """New tokens of one request from one step."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepOutputs:
    role: str
    updates: list[TokenUpdate] = field(default_factory=list)
    handoffs: list[SequenceWire] = field(default_factory=list)
    preempted: list[SequenceWire] = field(default_factory=list)


@dataclass(frozen=True)
class AbortMissed:
    """The worker did not hold these requests when their abort arrived."""

    request_ids: list[str]


@dataclass(frozen=True)
class Ready:
    role: str
    # SharedHandles of the worker that created the weights and pool (None from the attaching worker)
    handles: Any
    info: dict


@dataclass(frozen=True)
class WorkerFailed:
    role: str
    error: str
