"""The engine's model at start: the profile matching (device, model, dtype), else the roofline defaults."""

from __future__ import annotations

import logging

from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.kernels import dtype_bytes
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import find_profile
from bullet_ray.perf.roofline import H100_SXM, default_gpu_spec

logger = logging.getLogger(__name__)


def load_perf_model(gpu_name: str, sm_count: int, cfg: ModelConfig, dtype: str) -> tuple[PerfModel, str]:
    """(model, where its numbers came from: the profile's file name, its source (measured / derived) and date, or
    "roofline defaults"). Two profiles of one device share a file name (BULLET_RAY_PROFILE_DIR's shadows the
    package's), so the source and date tell a step log which one ran."""
    profile = find_profile(gpu_name, cfg, dtype)
    if profile is not None:
        logger.info("performance model: profile %s (%s, %s)", profile.file_name, profile.source, profile.date)
        return PerfModel.from_profile(profile, cfg), f"{profile.file_name} ({profile.source}, {profile.date})"
    spec = H100_SXM if sm_count == H100_SXM.sm_count else default_gpu_spec(gpu_name, sm_count)
    logger.warning("no performance profile for device %r, model %s, %s: using the roofline defaults "
                   "(run `bullet-ray profile` on this device to calibrate)", gpu_name,
                   cfg.architecture, dtype)
    return PerfModel(cfg, spec, dtype_bytes=dtype_bytes(dtype)), "roofline defaults"
