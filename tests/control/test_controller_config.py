"""The `controller:` section of the YAML args: parsed, bounds checked, bad keys named."""

from __future__ import annotations

import pydantic
import pytest

from bullet_ray.serve.config import BulletAppConfig


def test_controller_section_parses_and_defaults_to_none():
    assert BulletAppConfig().controller is None
    cfg = BulletAppConfig(controller={"app_name": "a", "prometheus_url": "http://h:9090", "max_decode_sms": 48})
    assert cfg.controller is not None and cfg.controller.max_decode_sms == 48 and cfg.controller.interval_s == 5.0


@pytest.mark.parametrize("section,needle", [
    ({"min_decode_sms": 64, "max_decode_sms": 32}, "min_decode_sms"),
    ({"min_engines": 3, "max_engines": 2}, "max_engines"),
    ({"interval_s": 0}, "interval_s"),
    ({"intervl_s": 1}, "intervl_s"),
])
def test_bad_controller_settings_name_the_field(section, needle):
    with pytest.raises(pydantic.ValidationError, match=needle):
        BulletAppConfig(controller=section)
