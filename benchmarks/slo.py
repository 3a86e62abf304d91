"""Moved to bullet_ray.bench.slo (the bench tool lives in the package; its deps come with the bench extra).

This alias keeps `from benchmarks.slo import ...` working: the module
object IS bullet_ray.bench.slo, so monkeypatching either name patches both.
"""

from __future__ import annotations

import sys

from bullet_ray.bench import slo as _module

sys.modules[__name__] = _module
