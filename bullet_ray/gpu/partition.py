"""SM partitioning behind one interface: a ladder of complementary (decode, prefill) splits and a stream per side.

Backends, registered by name and imported lazily (`register_backend` adds one):
  "green"  green contexts through native/libsmctl: real, switchable partitions (the default on a GPU).
  "mps"    CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, fixed per process by its environment: the ladder has one
           entry and cannot be switched (select(0) reports `False`: no hardware change). MPS limits how
           many SMs a client uses, not which: sides may share SMs.
  "none"   no hardware effect (CPU, or partitioning off): the ladder exists and records choices; streams
           are None (launch on the current stream).
  "auto"   green where the driver supports green contexts, else none.

Usage by a worker (one side per process; "both" for a single process that drives the two sides):

    p = make_partitioner("auto", "decode", device=0)
    p.select(index)                      # at a step boundary, when SplitSwitch says so
    with torch.cuda.stream(p.current_stream("decode")): ...   # or run on the current stream if None

The switching protocol between the two sides lives in bullet_ray.gpu.switch (re-exported here).
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Literal

from bullet_ray.errors import ConfigError
from bullet_ray.gpu.smctl import Capabilities
from bullet_ray.gpu.switch import DECODE_ACK, EPOCH, NUM_SWITCH_SLOTS, PREFILL_ACK, REQUESTED, SplitSwitch

__all__ = ["DECODE_ACK", "EPOCH", "NUM_SWITCH_SLOTS", "PREFILL_ACK", "REQUESTED", "BACKENDS", "SIDES",
           "LadderEntry", "SmPartitioner", "NonePartitioner", "MpsPartitioner", "SplitSwitch", "default_ladder",
           "make_partitioner", "register_backend"]

logger = logging.getLogger(__name__)

SideName = Literal["prefill", "decode", "both"]
SIDES: tuple[str, ...] = ("prefill", "decode", "both")
DEFAULT_SM_COUNT = 132  # H100 SXM; the none backend's ladder when no GPU says otherwise

# name -> "module:Class"; the module is imported when the backend is first made
_REGISTRY: dict[str, str] = {
    "green": "bullet_ray.gpu.green:GreenPartitioner",
    "mps": "bullet_ray.gpu.partition:MpsPartitioner",
    "none": "bullet_ray.gpu.partition:NonePartitioner",
}
BACKENDS: tuple[str, ...] = ("auto", *_REGISTRY)


@dataclass(frozen=True)
class LadderEntry:
    index: int  # position in the ladder
    decode_sms: int  # SMs of the decode side (as granted by the backend)
    prefill_sms: int  # SMs of the prefill side: the rest of the GPU


def default_ladder(sm_count: int, granularity: int = 8, margin_sms: int = 16) -> list[int]:
    """Decode SM counts from `margin_sms` to sm_count - margin_sms in steps of `granularity`
    (16, 24, ..., 112 on a 132-SM H100). A GPU too small for that gets one half/half entry."""
    if sm_count < 2:
        raise ConfigError("sm_count", f"{sm_count} SMs cannot be split; need at least 2")
    if granularity < 1:
        raise ConfigError("granularity", f"granularity {granularity} must be >= 1")
    if sm_count - margin_sms < margin_sms:
        return [max(1, sm_count // 2)]
    return list(range(margin_sms, sm_count - margin_sms + 1, granularity))


def check_ladder(counts: list[int], sm_count: int) -> None:
    """ConfigError naming the bad value unless every count is an int in [1, sm_count - 1]."""
    if not counts:
        raise ConfigError("decode_sm_counts", "the ladder is empty; give at least one decode SM count")
    for c in counts:
        if isinstance(c, bool) or not isinstance(c, int) or c < 1 or c >= sm_count:
            raise ConfigError("decode_sm_counts", f"decode SM count {c!r} is outside [1, {sm_count - 1}] "
                              f"(the GPU has {sm_count} SMs; each side needs at least one)")


def check_side(side: str) -> None:
    if side not in SIDES:
        raise ConfigError("side", f"unknown side {side!r}; choose one of {SIDES}")


class SmPartitioner(abc.ABC):
    """A ladder of complementary splits. Rules:
    - `ladder[i]` gives decode_sms + prefill_sms = the GPU's SMs; entries are fixed after construction,
      except a whole-GPU entry (decode every SM, prefill none) a worker may append (`add_whole_gpu_entry`).
    - `stream(i, side)` is where `side` launches work while on entry i (None: the current stream); a
      process gets streams only for the side(s) it was made for.
    - `select(i)` is called at a step boundary (disjoint switch: after the side's earlier work finished;
      overlap switch: with it possibly still running, the next launch waiting on it); it returns True
      when the hardware partition changes, False when the backend cannot switch (mps, none).
    - `close()` releases streams and contexts; the partitioner is unusable afterwards.
    """

    name = "abstract"
    is_switchable = False  # does select() change which SMs run the work?

    def __init__(self, side: SideName, capabilities: Capabilities) -> None:
        check_side(side)
        self.side = side
        self.capabilities = capabilities
        self.ladder: list[LadderEntry] = []
        self.current_index = 0
        self.num_selects = 0  # select() calls so far: the mark `selected_since` takes
        self._last_select: dict[int, int] = {}  # ladder index -> the number of the last select() that chose it
        self.whole_index: int | None = None  # the whole-GPU entry (`add_whole_gpu_entry`), if any

    def add_whole_gpu_entry(self) -> int:
        """Append an entry past the ladder's last where decode has every SM and prefill none (the bullet
        schedule's mixed fallback: the decode side alone runs chunked-prefill steps on the whole GPU; the
        prefill side must not launch there). Returns its index."""
        if self.whole_index is None:
            first = self.ladder[0]
            self.ladder.append(LadderEntry(len(self.ladder), first.decode_sms + first.prefill_sms, 0))
            self.whole_index = len(self.ladder) - 1
            self._add_whole_gpu_streams(self.whole_index)
        return self.whole_index

    def _add_whole_gpu_streams(self, index: int) -> None:  # noqa: B027 - streams only where the backend has some
        """The whole-GPU entry's decode stream, for backends whose streams bind SMs."""

    def _check_index(self, index: int) -> None:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(self.ladder):
            raise ConfigError("split_index", f"ladder index {index!r} outside [0, {len(self.ladder)}) "
                              f"({self.name} backend)")

    def _check_stream_side(self, side: str) -> None:
        if side not in ("prefill", "decode"):
            raise ConfigError("side", f"unknown side {side!r}; streams exist for 'prefill' and 'decode'")
        if self.side != "both" and side != self.side:
            raise ConfigError("side", f"this process made the {self.side!r} side only, not {side!r}")

    def select(self, index: int) -> bool:
        """Run on ladder entry `index` from the next step on; True if the SMs in use change."""
        self._check_index(index)
        changed = self.is_switchable and index != self.current_index
        self.current_index = index
        self.num_selects += 1
        self._last_select[index] = self.num_selects
        return changed

    def selected_since(self, mark: int) -> set[int]:
        """The ladder indexes select() chose after `num_selects` was `mark` (what a layer-wise prefill asks: did
        its side move between its groups?). Kept per entry, so it stays the ladder's size however long a worker
        serves."""
        return {index for index, number in self._last_select.items() if number > mark}

    @abc.abstractmethod
    def stream(self, index: int, side: str) -> Any:
        """A torch stream bound to `side`'s SMs on entry `index`, or None (launch on the current stream)."""

    def current_stream(self, side: str | None = None) -> Any:
        return self.stream(self.current_index, side or self.side)

    @property
    def current(self) -> LadderEntry:
        return self.ladder[self.current_index]

    def close(self) -> None:  # noqa: B027 - optional for backends without resources
        """Release streams and contexts."""

    def __enter__(self) -> SmPartitioner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cpu_caps(sm_count: int, reason: str) -> Capabilities:
    return Capabilities(0, sm_count, False, 0, 0, reason)


class NonePartitioner(SmPartitioner):
    """No partitioning: the ladder is bookkeeping only (CPU, tests, or partitioning turned off)."""

    name = "none"

    def __init__(self, side: SideName, sm_count: int = DEFAULT_SM_COUNT, decode_sm_counts: list[int] | None = None,
                 capabilities: Capabilities | None = None) -> None:
        super().__init__(side, capabilities or _cpu_caps(sm_count, "none backend: no hardware partitioning"))
        counts = list(decode_sm_counts) if decode_sm_counts is not None else default_ladder(sm_count)
        check_ladder(counts, sm_count)
        self.ladder = [LadderEntry(i, c, sm_count - c) for i, c in enumerate(counts)]

    def stream(self, index: int, side: str) -> Any:
        self._check_index(index)
        self._check_stream_side(side)
        return None


def mps_thread_percentage(env: dict[str, str] | None = None) -> float:
    """This process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (100 when unset): the share of the SMs its kernels may use
    under MPS. ConfigError when it is not a number in (0, 100]."""
    raw = (os.environ if env is None else env).get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "100")
    try:
        pct = float(raw)
    except ValueError:
        raise ConfigError("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", f"{raw!r} is not a number") from None
    if not 0 < pct <= 100:
        raise ConfigError("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", f"{pct} is outside (0, 100]")
    return pct


class MpsPartitioner(SmPartitioner):
    """One fixed split from this process's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (its side's share)."""

    name = "mps"

    def __init__(self, side: SideName, sm_count: int = DEFAULT_SM_COUNT, capabilities: Capabilities | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(side, capabilities or _cpu_caps(sm_count, "mps backend"))
        if side == "both":
            raise ConfigError("side", "the mps backend partitions per process: make it for 'prefill' or 'decode'")
        pct = mps_thread_percentage(env)
        mine = min(sm_count, max(1, round(sm_count * pct / 100)))
        decode = mine if side == "decode" else sm_count - mine
        self.ladder = [LadderEntry(0, decode, sm_count - decode)]
        self.percentage = pct

    def select(self, index: int) -> bool:
        if index != 0:
            logger.info("mps backend: the split is fixed by CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=%s; switch to %s "
                        "ignored", self.percentage, index)
        return super().select(index)

    def stream(self, index: int, side: str) -> Any:
        self._check_index(index)
        self._check_stream_side(side)
        return None


def register_backend(name: str, target: str) -> None:
    """Register a backend class as "module:Class" (imported when first made)."""
    global BACKENDS
    if ":" not in target:
        raise ConfigError("target", f"{target!r} must read 'module:Class'")
    _REGISTRY[name] = target
    BACKENDS = ("auto", *_REGISTRY)


def backend_class(name: str) -> type[SmPartitioner]:
    if name not in _REGISTRY:
        raise ConfigError("partition", f"unknown partition backend {name!r}; choose one of {BACKENDS}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def make_partitioner(backend: str, side: SideName, device: int = 0, decode_sm_counts: list[int] | None = None,
                     sm_count: int | None = None) -> SmPartitioner:
    """The named backend for `side` on CUDA device `device`. "auto" = green where the driver has green
    contexts, else none. `sm_count` sizes the none/mps ladders (default: the GPU's, else 132)."""
    check_side(side)
    if backend not in BACKENDS:
        raise ConfigError("partition", f"unknown partition backend {backend!r}; choose one of {BACKENDS}")
    if backend in ("green", "auto"):
        from bullet_ray.gpu import smctl

        caps = smctl.capability_report(device)
        if caps.green_ctx_supported:
            return backend_class("green")(side, device, decode_sm_counts)  # type: ignore[call-arg, arg-type]
        if backend == "green":
            raise smctl.NotSupportedError(f"green contexts unavailable on device {device}: {caps.reason}")
        logger.info("partition auto: none backend (%s)", caps.reason)
        n = sm_count or caps.sm_count or DEFAULT_SM_COUNT
        return NonePartitioner(side, n, decode_sm_counts, dataclasses.replace(caps, sm_count=n))
    cls = backend_class(backend)
    if cls is NonePartitioner:
        return NonePartitioner(side, sm_count or DEFAULT_SM_COUNT, decode_sm_counts)
    if cls is MpsPartitioner:
        if sm_count is None:
            from bullet_ray.gpu import smctl

            caps = smctl.capability_report(device)
            n = caps.sm_count or DEFAULT_SM_COUNT
            return MpsPartitioner(side, n, dataclasses.replace(caps, sm_count=n))
        return MpsPartitioner(side, sm_count)
    return cls(side, device, decode_sm_counts)  # type: ignore[call-arg, arg-type]


def __getattr__(name: str) -> Any:  # GreenPartitioner without importing torch at module import
    if name == "GreenPartitioner":
        return backend_class("green")
    raise AttributeError(name)
