"""The Ray Serve application: `bullet_ray.serve:build_app` (ingress, engine replicas, router)."""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    from bullet_ray.serve.app import build_app as _build

    return _build(args, **kwargs)


__all__ = ["build_app"]
