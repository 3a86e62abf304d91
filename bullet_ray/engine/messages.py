"""Messages between the engine front and its workers (pickled over one Unix-socket connection each).

Engine -> worker: AddRequest (AddRequests: several in one message), AbortRequests, Shutdown, Wake, ConnectHandoff
(to the prefill worker, once).
Worker -> engine: Handles (once, from the worker that creates the shared memory, before it captures its graphs: the
front then starts the other worker), Ready (once), StepOutputs (one per step that produced anything: its tokens as
arrays), AbortMissed, WorkerFailed. A prefill worker's StepOutputs carry the sequences it finished prefilling
(`handoffs`) and, under the mixed fallback, the queued prompts it hands over (`prompts_handed_over`); the engine
relays each to the decode worker as a `Handoff` (`is_prompt` for the second kind). With `handoff: direct` the prefill worker sends a
prefilled sequence's `Handoff` to the decode worker itself and names it in `handed_direct` instead
(bullet_ray.engine.worker.handoff). A decode worker's StepOutputs carry sequences it preempted (blocks already
freed); the engine sends them back to prefill for recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from bullet_ray.engine.outputs import FinishReason, TokenLogprob
from bullet_ray.engine.sampling_params import SamplingParams
from bullet_ray.engine.sequence import SequenceWire

if TYPE_CHECKING:
    from bullet_ray.config import EngineConfig

WorkerRole = Literal["prefill", "decode", "hybrid"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to start; picklable, sent once (by `bullet_ray.engine.launcher`'s
    launchers; here so that the worker, which reads it, does not import the launcher that starts it)."""

    role: WorkerRole
    config: EngineConfig
    # the engine front's Unix socket path and the key that authenticates this engine's workers
    address: str
    authkey: bytes
    # for the second worker of a pair: handles of the first worker's weights, KV pool, allocator and
    # state block (a `SharedHandles`); None for the worker that loads the model
    attach: Any = None


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
class AddRequests:
    """Several new requests in one message, in order: `LLMEngine.generate` submits its list this way, one write
    per ~256k prompt tokens instead of one per request (a pipe holds ~12 prompts of ~1k tokens: the front then
    waited for the busy worker to read each dozen between its steps)."""
    requests: list[AddRequest]

    # about this many prompt tokens per message (~1 MB pickled): one write per piece, and the front's send lock
    # (which its receiver thread's aborts also take) held for a bounded time
    PIECE_TOKENS: ClassVar[int] = 262_144

    @staticmethod
    def pieces(adds: list[AddRequest], max_tokens: int = PIECE_TOKENS) -> Iterator[list[AddRequest]]:
        """`adds` cut, in order, into runs of at most `max_tokens` prompt tokens (a longer prompt alone)."""
        piece: list[AddRequest] = []
        tokens = 0
        for add in adds:
            if piece and tokens + len(add.prompt_token_ids) > max_tokens:
                yield piece
                piece, tokens = [], 0
            piece.append(add)
            tokens += len(add.prompt_token_ids)
        if piece:
            yield piece


@dataclass(frozen=True)
class Handoff:
    """A sequence for the decode worker: prefilled (KV in the pool, first token sampled: it decodes from its next
    step), or with `is_prompt` a queued prompt the mixed fallback hands over (nothing or part of it computed: the
    decode worker prefills the rest in chunks; counted in the state block's hand-over counters)."""

    seq: SequenceWire
    is_prompt: bool = False
    # the prefill worker's StepOutputs stamp (either way): the decode worker times the hand-off's hop from it
    sent_s: float = 0.0
    # the way it came: "direct" from the prefill worker, "front" relayed by the engine front
    via: str = "direct"


@dataclass(frozen=True)
class ConnectHandoff:
    """To the prefill worker: connect to the decode worker's hand-off socket at `address` (`handoff: direct`)."""

    address: str


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
    """New tokens of one request from one step (the front's view of one row of StepOutputs)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepOutputs:
    """Everything one step of one worker produced, in one message.

    Tokens travel as two parallel lists (request i sampled token i), not as one object per token, so a
    step of 256 sequences pickles two lists; the rare extras are sparse, keyed by row. `sent_s`
    (time.time() at send) lets the front measure the hop."""

    role: str
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    # row -> (finish reason, stop token id) for the requests this step finished
    finished: dict[int, tuple[FinishReason, int | None]] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    handoffs: list[SequenceWire] = field(default_factory=list)
    # the prefill worker's queued prompts handed to the decode worker (mixed fallback; part-way ones with blocks)
    prompts_handed_over: list[SequenceWire] = field(default_factory=list)
    preempted: list[SequenceWire] = field(default_factory=list)
    # ids of prefilled sequences this prefill worker sent to the decode worker itself (`handoff: direct`)
    handed_direct: list[str] = field(default_factory=list)
    # the decode worker's hand-offs taken since its last message: seconds from the prefill worker's send
    handoff_hops_s: list[float] = field(default_factory=list)
    sent_s: float = 0.0
    # CUDA graphs this worker captured while serving so far (0 unless a shape was missed at start)
    num_graph_captures_serving: int = 0
    # sequences this worker sent back for recompute on its own so far (the chunked schedule's preemptions,
    # waiting prompts whose KV was released for the head); decode's preemptions reach the front as `preempted`
    num_recomputed: int = 0

    def updates(self) -> Iterator[TokenUpdate]:
        for i, (rid, token) in enumerate(zip(self.request_ids, self.token_ids)):
            lp = self.logprobs.get(i)
            reason, stop = self.finished.get(i, (None, None))
            yield TokenUpdate(rid, [token], [lp] if lp is not None else None, reason, stop)


@dataclass(frozen=True)
class AbortMissed:
    """The worker did not hold these requests when their abort arrived."""

    request_ids: list[str]


@dataclass(frozen=True)
class Handles:
    """From the worker that created the shared weights, KV pool and state block (`WorkerSpec.attach` None), as soon as
    the other worker may map them: before it captures its CUDA graphs (bullet_ray.engine.startup_order)."""

    role: str
    handles: Any  # a SharedHandles (bullet_ray.engine.worker.setup): what the attaching worker's WorkerSpec carries
    pid: int  # the worker's process: the front's watchdog stops it should the front die while the workers start


@dataclass(frozen=True)
class Ready:
    """A worker built and its graphs captured: it serves from now on (after Handles, from the creating worker)."""

    role: str
    info: dict  # device, graphs, ladder size, start-up seconds by part (run_worker)


@dataclass(frozen=True)
class WorkerFailed:
    role: str
    error: str
