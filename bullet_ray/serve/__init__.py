"""The Ray Serve application: `bullet_ray.serve:build_app` (ingress, engine replicas, router)."""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any]) -> Any:
    """The application builder `serve run` / `serve deploy` call with the YAML's `args` (one parameter, as
    Serve requires). Tests that need a mock engine use `bullet_ray.serve.app.build_app(args, engine_factory)`."""
    from bullet_ray.serve.app import build_app as _build

    return _build(args)


__all__ = ["build_app"]
