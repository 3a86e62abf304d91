"""Typed errors shared by every layer. Each names the bad value and the fix."""

from __future__ import annotations


class BulletRayError(Exception):
    """Base class of every error bullet_ray raises on purpose."""


class ConfigError(BulletRayError, ValueError):
    """A configuration field has a bad value. `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidSamplingParams(BulletRayError, ValueError):
    """A sampling parameter is out of range. `field` names it (OpenAI's name where one exists)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidRequest(BulletRayError, ValueError):
    """A request cannot be served as asked (empty prompt, too long for the model or the KV pool)."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.field = field
        self.code = code


class EngineDeadError(BulletRayError, RuntimeError):
    """A worker process of the engine exited; the engine cannot serve any more requests."""


class ModelLoadError(BulletRayError, RuntimeError):
    """A model could not be found or loaded. The message says where it looked."""
