"""The shared "which Serve apps exist" check and the absence clock, without Ray: the Serve controller lookup,
`serve.status()` and the client cache replaced by fakes."""

from __future__ import annotations

import threading
import time

import pytest
from ray.exceptions import ActorDiedError

from bullet_ray.control import serve_apps
from bullet_ray.control.serve_apps import AppWatch, serve_app_names


class FakeServe:
    """A Serve controller that may be missing, and a `serve.status()` whose cached client may be stale."""

    def __init__(self, monkeypatch, apps=("a",), has_controller=True, num_stale=0, error=None):
        self.apps, self.has_controller, self.num_stale, self.error = frozenset(apps), has_controller, num_stale, error
        self.num_drops = 0
        self.num_status = 0
        monkeypatch.setattr(serve_apps, "_serve_controller_exists", lambda: self._exists())
        monkeypatch.setattr(serve_apps, "_serve_status_apps", self.status)
        monkeypatch.setattr(serve_apps, "_drop_serve_client", self.drop)

    def _exists(self) -> bool:
        if isinstance(self.has_controller, Exception):
            raise self.has_controller
        return self.has_controller

    def status(self) -> frozenset[str]:
        self.num_status += 1
        if self.error is not None:
            raise self.error
        if self.num_stale > self.num_drops:  # the cached client is the dead controller's until dropped
            raise ActorDiedError()
        return self.apps

    def drop(self) -> None:
        self.num_drops += 1


def test_apps_of_a_running_serve(monkeypatch):
    fake = FakeServe(monkeypatch, apps=("a", "b"))
    assert serve_app_names() == {"a", "b"} and fake.num_drops == 0


def test_no_serve_controller_means_no_apps(monkeypatch):
    fake = FakeServe(monkeypatch, has_controller=False)
    assert serve_app_names() == frozenset() and fake.num_status == 0


def test_a_stale_client_is_dropped_and_serve_asked_again(monkeypatch):
    fake = FakeServe(monkeypatch, apps=("b",), num_stale=1)  # Serve shut down and started again
    assert serve_app_names() == {"b"}
    assert (fake.num_drops, fake.num_status) == (1, 2)


def test_two_actor_errors_in_a_row_are_unknown(monkeypatch):
    fake = FakeServe(monkeypatch, num_stale=5)
    assert serve_app_names() is None and fake.num_status == 2  # asked once more, not forever


@pytest.mark.parametrize("error", [TimeoutError("busy"), RuntimeError("boom")])
def test_other_failures_are_unknown(monkeypatch, error):
    fake = FakeServe(monkeypatch, error=error)
    assert serve_app_names() is None and fake.num_drops == 0


def test_a_serve_status_that_does_not_answer_is_unknown(monkeypatch):
    """serve.status() has no timeout of its own: the lookup answers None after its timeout, and while that one
    still hangs a later lookup answers None at once (one hung thread, not one per call)."""
    release = threading.Event()
    fake = FakeServe(monkeypatch)
    answer = fake.status

    def hanging() -> frozenset[str]:
        release.wait(10.0)
        return answer()

    monkeypatch.setattr(serve_apps, "_serve_status_apps", hanging)
    start = time.monotonic()
    assert serve_app_names(timeout_s=0.2) is None
    assert serve_app_names(timeout_s=0.2) is None
    assert time.monotonic() - start < 2.0 and fake.num_status == 0
    release.set()
    deadline = time.monotonic() + 5.0
    while fake.num_status == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert serve_app_names(timeout_s=5.0) == {"a"} and fake.num_status == 2


def test_a_failed_controller_lookup_is_unknown(monkeypatch):
    FakeServe(monkeypatch, has_controller=ConnectionError("gcs down"))
    assert serve_app_names() is None


def test_watch_leaves_only_after_the_grace_period_of_absence():
    watch = AppWatch(10.0, {"a"})
    assert not watch.observe(frozenset({"a"}), 0.0)
    assert not watch.observe(frozenset(), 1.0)  # the clock starts at the first absent answer
    assert not watch.observe(frozenset({"x"}), 10.9)
    assert watch.observe(frozenset(), 11.0)


def test_a_present_answer_resets_the_clock():
    watch = AppWatch(10.0, {"a"})
    watch.observe(frozenset(), 0.0)
    watch.observe(frozenset({"a"}), 5.0)  # redeployed within the grace period
    assert not watch.observe(frozenset(), 12.0)
    assert watch.observe(frozenset(), 22.0)


def test_unknown_answers_restart_the_absence_clock():
    """Time while Serve cannot tell does not count toward the grace period: only an unbroken run of absent
    answers at least `grace_s` long ends the watch."""
    watch = AppWatch(10.0, {"a"})
    assert not watch.observe(None, 0.0) and watch.absent_since_s is None  # unknown starts nothing
    watch.observe(frozenset(), 1.0)
    assert not watch.observe(None, 50.0)  # nor ends anything
    assert watch.absent_since_s is None  # and breaks the absent run
    assert not watch.observe(frozenset(), 51.0)  # the clock starts again here
    assert not watch.observe(frozenset(), 60.9)
    assert watch.observe(frozenset(), 61.0)


def test_absent_then_unknown_for_longer_than_the_grace_period_is_not_gone():
    """The review's case: absent at 0 s, unknown at 60, 119, 121 s, absent at 125 s with a 120 s grace period
    was counted as gone (the unknown stretch counted as absence)."""
    watch = AppWatch(120.0, {"a"})
    assert not watch.observe(frozenset(), 0.0)
    for t in (60.0, 119.0, 121.0):
        assert not watch.observe(None, t)
    assert not watch.observe(frozenset(), 125.0)
    assert not watch.observe(frozenset(), 244.0)
    assert watch.observe(frozenset(), 245.0)


def test_every_served_app_must_be_gone():
    watch = AppWatch(0.0)
    assert watch.is_present(frozenset({"a"})) is False  # serves nothing yet: counts as absent
    watch.add(["a", "b"])
    assert watch.is_present(frozenset({"b"})) and watch.is_present(None) is None
    assert not watch.observe(frozenset({"b"}), 0.0)
    assert watch.observe(frozenset({"c"}), 0.0)


def test_a_served_app_added_restarts_the_clock():
    """A caller names an application it serves now: an absent answer asked before it was deployed ends nothing."""
    watch = AppWatch(10.0, {"a"})
    watch.observe(frozenset(), 0.0)
    watch.add(["b"])
    assert watch.absent_since_s is None and not watch.observe(frozenset(), 11.0)
    assert watch.observe(frozenset(), 21.0)
