"""Moved to bullet_ray.bench.compare (the bench tool lives in the package; its deps come with the bench extra).

This alias keeps `python -m benchmarks.compare` and `from benchmarks.compare import ...` working: the module
object IS bullet_ray.bench.compare, so monkeypatching either name patches both.
"""

from __future__ import annotations

import sys

from bullet_ray.bench import compare as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
