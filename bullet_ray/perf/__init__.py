"""bullet_ray.perf: the SM-scaling performance model (pure Python, no torch).

roofline.py (GpuSpec, compute/bandwidth vs SMs), kernels.py (FLOPs and bytes per kernel class of a step),
calibration/ (factors, their least-squares fit, online correction), profile.py (the JSON profile),
model.py (PerfModel: step-time predictions), ttft.py (queued requests' TTFT), loading.py (the engine's
profile lookup). `bullet-ray profile` (profile_cli.py, sweep.py) measures a profile on a device.
"""

from bullet_ray.perf.kernels import KernelClass, StepShape
from bullet_ray.perf.model import PerfModel
from bullet_ray.perf.profile import Profile, find_profile, load_profile, save_profile
from bullet_ray.perf.roofline import GpuSpec

__all__ = ["GpuSpec", "KernelClass", "PerfModel", "Profile", "StepShape", "find_profile", "load_profile",
           "save_profile"]
