"""bullet_ray: LLM serving on Ray Serve with prefill and decode side by side on one GPU.

The public API is re-exported lazily so that `import bullet_ray` stays cheap (no torch import).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLMEngine":
        from bullet_ray.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "SamplingParams":
        from bullet_ray.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
