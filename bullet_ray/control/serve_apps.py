"""Which Serve applications exist, asked from a long-lived actor, and when the ones an actor serves are gone.

The cluster controller (one per application) and the node agents (shared by every application) both leave
once what they serve has been gone for a while; this is the check they share:
- `serve_app_names()`: the names of the applications Serve runs now, or None when it cannot tell.
- `AppWatch`: the applications one actor serves and whether all of them have been absent for a grace period.

The lookup runs in a worker thread and answers None (unknown) after `LOOKUP_TIMEOUT_S`: `serve.status()` has no
timeout of its own and waits as long as the Serve controller does not answer. At most one lookup is in flight per
process: while one hangs, later calls answer None at once instead of piling up threads.

Why not `serve.status()` alone: Ray Serve caches its client (the Serve controller's handle) in a module global
(`ray.serve.context._global_client`, Ray 2.60). After `serve.shutdown()` a long-lived actor keeps the dead
controller's handle, so every later `serve.status()` raises an actor error, even once Serve runs again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

logger = logging.getLogger(__name__)

APP_GONE_S = 120.0  # the shortest time an application must be absent before what serves it leaves (a redeploy's gap)
SERVE_CONTROLLER_NAME = "SERVE_CONTROLLER_ACTOR"  # ray.serve._private.constants, Ray 2.60
SERVE_NAMESPACE = "serve"
LOOKUP_TIMEOUT_S = 10.0  # a lookup not answered within this is unknown (None)

_lookup_lock = threading.Lock()
_pending: Future[frozenset[str] | None] | None = None  # the lookup in flight (its thread may hang), if any


def _serve_controller_exists() -> bool:
    """False when no Serve controller actor is registered (ray.get_actor raises ValueError for a missing name)."""
    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _serve_status_apps() -> frozenset[str]:
    from ray import serve

    return frozenset(serve.status().applications)


def _drop_serve_client() -> None:
    """Forget Ray Serve's cached client, so the next call looks the Serve controller up by name again."""
    from ray.serve import context

    context._set_global_client(None)


def _in_thread(fn: Callable[[], frozenset[str] | None]) -> Future[frozenset[str] | None]:
    """`fn()` in a daemon thread (one that hangs does not keep the process alive); its future."""
    future: Future[frozenset[str] | None] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(e)

    threading.Thread(target=run, name="bullet-serve-apps", daemon=True).start()
    return future


def serve_app_names(timeout_s: float = LOOKUP_TIMEOUT_S) -> frozenset[str] | None:
    """The Serve applications that exist now; None when unknown (never clean anything up on None).

    No Serve controller actor: no applications. `serve.status()` failing with an actor error: its cached
    client is stale (Serve was shut down, maybe started again), so the client is dropped and Serve asked once
    more. Any other failure, a second actor error, no answer within `timeout_s`, or an earlier lookup still
    unanswered: unknown."""
    global _pending
    with _lookup_lock:
        if _pending is not None and not _pending.done():
            logger.warning("an earlier lookup of the Serve applications is still unanswered")
            return None
        _pending = future = _in_thread(_lookup_app_names)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeout:  # the built-in TimeoutError from Python 3.11 on, not before
        logger.warning("the lookup of the Serve applications did not answer within %.0f s", timeout_s)
        return None


def _lookup_app_names() -> frozenset[str] | None:
    """serve_app_names without its timeout."""
    try:
        if not _serve_controller_exists():
            return frozenset()
    except Exception as e:  # noqa: BLE001 - the GCS not answering: unknown, not "no apps"
        logger.warning("cannot look up the Serve controller: %s", e)
        return None
    for attempt in (1, 2):
        try:
            return _serve_status_apps()
        except RayActorError as e:
            if attempt == 2:
                logger.warning("serve.status() failed twice with an actor error: %s", e)
                return None
            logger.info("serve.status() failed with an actor error (a stale Serve client); asking again: %s", e)
            _drop_serve_client()
        except Exception as e:  # noqa: BLE001 - e.g. Serve's controller not ready yet; no answer at all is
            logger.warning("serve.status() failed: %s", e)  # serve_app_names' timeout
            return None
    return None  # not reached


@dataclass
class AppWatch:
    """The applications one actor serves and how long all of them have been absent.

    Absent means `serve_app_names()` answered and named none of them (an actor that was never told an
    application serves none, so it counts as absent too). Only a run of known-absent answers ends the watch:
    one that names none of them, `grace_s` or more after the first answer of an unbroken run of absent ones.
    A present answer and an unknown one (None) both break the run (the clock starts again at the next absent
    answer): time while Serve cannot tell says nothing about whether the applications were away."""

    grace_s: float  # how long every served application must be absent (s)
    app_names: set[str] = field(default_factory=set)  # the applications this actor serves
    absent_since_s: float | None = None  # monotonic time of the first of an unbroken run of absent answers

    def add(self, app_names: Iterable[str]) -> None:
        """Applications a caller serves now (a controller calls only while its application runs): they join
        the served ones and the absence clock restarts (an answer of `serve_app_names()` from before this call
        may not name an application just deployed)."""
        self.app_names.update(app_names)
        self.absent_since_s = None

    def is_present(self, names: frozenset[str] | None) -> bool | None:
        """Whether any served application is in `names` (None: unknown)."""
        return None if names is None else bool(self.app_names & names)

    def observe(self, names: frozenset[str] | None, now_s: float) -> bool:
        """Take one answer of `serve_app_names()`; True once every served application has been gone `grace_s`."""
        if self.is_present(names) is not False:  # present or unknown: the absence run is broken
            self.absent_since_s = None
            return False
        if self.absent_since_s is None:
            self.absent_since_s = now_s
        return now_s - self.absent_since_s >= self.grace_s
