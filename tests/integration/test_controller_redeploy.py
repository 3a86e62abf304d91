"""A redeploy reaches the application's running controller (a detached actor `start_controller` finds): new
`controller:` settings take effect, the same ones change nothing, and a restart by Ray keeps the newer ones.
The controller's interval is an hour, so it never decides during the test (no application, no metrics)."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.ray]

APP = "redeploy_test"


def wait_for_restart(controller, timeout_s: float = 60.0) -> dict:
    """The status of the controller's restarted process (ray.kill returns before the old one is gone)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            status = ray.get(controller.status.remote(), timeout=10)
            if status["num_restores"] > 0:
                return status
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"the controller did not come back within {timeout_s:.0f} s")


def test_a_redeploy_hands_the_running_controller_its_settings(ray_session):
    import ray

    from bullet_ray.control.config import ControllerConfig
    from bullet_ray.control.controller import AppSpec, start_controller, stop_controller

    spec = AppSpec("m", accelerator="fake_gpu", num_engines=1)
    first = ControllerConfig(app_name=APP, interval_s=3600.0, max_decode_sms=96)
    stop_controller(APP)  # an earlier run's, on a reused cluster
    try:
        controller = start_controller(first, spec)
        ray.get(controller.update_config.remote({"max_decode_sms": 48, "min_decode_sms": 16}))
        before = ray.get(controller.status.remote())

        same = start_controller(first, spec)  # the same settings: nothing changes
        assert ray.get(same.status.remote()) == before

        second = first.model_copy(update={"interval_s": 1800.0, "max_decode_sms": 64})
        status = ray.get(start_controller(second, spec).status.remote())
        assert (status["config"]["interval_s"], status["config"]["max_decode_sms"]) == (1800.0, 64)
        assert status["overrides"] == {"min_decode_sms": 16} and status["num_restores"] == 0

        ray.kill(controller, no_restart=False)  # Ray restarts it with the first deploy's arguments
        restarted = wait_for_restart(controller)
        assert restarted["num_restores"] == 1
        assert (restarted["config"]["interval_s"], restarted["config"]["max_decode_sms"]) == (1800.0, 64)
    finally:
        stop_controller(APP)
