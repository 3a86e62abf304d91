"""Attention backends over the paged KV pool, registered by name and imported lazily."""

from __future__ import annotations

from bullet_ray.engine.attention.base import AttentionBackend, AttentionMetadata, get_backend_class

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend_class"]
