"""Which Serve applications exist, asked from a long-lived actor, and when the ones an actor serves are gone.

The cluster controller (one per application) and the node agents (shared by every application) both leave
once what they serve has been gone for a while; this is the check they share:
- `serve_app_names()`: the names of the applications Serve runs now, or None when it cannot tell.
- `AppWatch`: the applications one actor serves and whether all of them have been absent for a grace period.

Why not `serve.status()` alone: Ray Serve caches its client (the Serve controller's handle) in a module global
(`ray.serve.context._global_client`, Ray 2.60). After `serve.shutdown()` a long-lived actor keeps the dead
controller's handle, so every later `serve.status()` raises an actor error, even once Serve runs again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError

logger = logging.getLogger(__name__)

APP_GONE_S = 120.0  # the shortest time an application must be absent before what serves it leaves (a redeploy's gap)
SERVE_CONTROLLER_NAME = "SERVE_CONTROLLER_ACTOR"  # ray.serve._private.constants, Ray 2.60
SERVE_NAMESPACE = "serve"


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


def serve_app_names() -> frozenset[str] | None:
    """The Serve applications that exist now; None when unknown (never clean anything up on None).

    No Serve controller actor: no applications. `serve.status()` failing with an actor error: its cached
    client is stale (Serve was shut down, maybe started again), so the client is dropped and Serve asked once
    more. Any other failure, or a second actor error: unknown."""
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
        except Exception as e:  # noqa: BLE001 - e.g. a timeout of a busy Serve controller
            logger.warning("serve.status() failed: %s", e)
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
