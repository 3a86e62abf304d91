"""Moved to bullet_ray.bench.serve_bench (the bench tool lives in the package; its deps come with the bench extra).

This alias keeps `python -m benchmarks.serve_bench` and `from benchmarks.serve_bench import ...` working: the module
object IS bullet_ray.bench.serve_bench, so monkeypatching either name patches both.
"""

from __future__ import annotations

import sys

from bullet_ray.bench import serve_bench as _module

if __name__ == "__main__":
    sys.exit(_module.main())
sys.modules[__name__] = _module
