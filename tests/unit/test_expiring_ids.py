"""ExpiringIds: request ids held for a while (the front's finished ids, the decode worker's abort tombstones)."""

from __future__ import annotations

import time

import pytest

from bullet_ray.engine.expiring_ids import ExpiringIds


def test_an_id_is_held_until_its_hold_ends_and_take_forgets_it():
    ids = ExpiringIds(hold_s=60.0, max_ids=8)
    ids.add("a")
    assert ids.holds("a") and ids.holds("a") and not ids.holds("b")  # holds() keeps it
    assert ids.take("a") and not ids.take("a") and not ids.holds("a")  # take() forgets it
    short = ExpiringIds(hold_s=0.0, max_ids=8)
    short.add("b")
    time.sleep(0.001)
    assert not short.holds("b") and not short.take("b")
    for rid in "cde":
        short.add(rid)
    time.sleep(0.001)
    short.add("f")  # an add drops the expired ones first: the set stays small below its cap
    assert list(short) == ["f"]


def test_at_the_cap_the_oldest_goes_and_re_adding_renews():
    ids = ExpiringIds(hold_s=60.0, max_ids=3)
    for rid in "wxy":
        ids.add(rid)
    ids.add("w")  # renewed: now the newest
    ids.add("z")  # full: x, the oldest, goes
    assert list(ids) == ["y", "w", "z"] and len(ids) == 3 and not ids.holds("x")


@pytest.mark.parametrize(("hold_s", "max_ids"), [(-1.0, 8), (float("nan"), 8), (1.0, 0)])
def test_bad_settings_are_refused(hold_s, max_ids):
    with pytest.raises(ValueError):
        ExpiringIds(hold_s, max_ids)
