"""Moved to bullet_ray.bench.report (the bench tool lives in the package; its deps come with the bench extra).

This alias keeps `python -m benchmarks.report` and `from benchmarks.report import ...` working: the module
object IS bullet_ray.bench.report, so monkeypatching either name patches both.
"""

from __future__ import annotations

import sys

from bullet_ray.bench import report as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
