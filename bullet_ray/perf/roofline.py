"""The SM-scaling roofline: how long a kernel of given FLOPs and bytes takes on n of a GPU's SMs.

Compute grows in proportion to the SMs a kernel gets; memory bandwidth grows with them and then
saturates, because a few SMs already keep enough loads in flight to fill the memory system:

    compute(n)   = peak_flops x n / sm_count
    bandwidth(n) = peak_bandwidth x g(n) / g(sm_count),   g(n) = x / (1 + x^p)^(1/p),  x = n / saturation_sms
    time(n)      = max(flops / compute(n), bytes / bandwidth(n))
                 = flops / min(intensity x bandwidth(n), compute(n))      (intensity = flops / bytes)

g rises linearly (x) well below saturation_sms and flattens to 1 above it; `knee` (p) says how sharp the
bend is (p -> infinity gives min(1, x)). On the H100 a decode-like GEMV reached 708 / 1335 / 1972 / 2210 /
2461 / 2616 GB/s on 8 / 16 / 32 / 48 / 72 / 132 SMs (GPU.md); saturation_sms 28.5 and knee 1.9 fit those
within 3%. Pure Python.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bullet_ray.errors import ConfigError


@dataclass(frozen=True)
class GpuSpec:
    """A device's ceilings, whole-device figures as kernels really reach them (not datasheet peaks)."""

    name: str  # the device name as torch/NVML report it ("NVIDIA H100 80GB HBM3", "cpu")
    sm_count: int  # SMs of the whole device (1 for a CPU: no ladder)
    peak_tflops: float  # dense matmul throughput on the whole device (TFLOP/s)
    peak_bandwidth_gbs: float  # memory bandwidth a streaming kernel reaches on the whole device (GB/s)
    saturation_sms: float  # SMs around which bandwidth stops growing (> 0)
    knee: float = 2.0  # sharpness of the bandwidth bend (> 0; large = a hard min(1, n / saturation_sms))

    def __post_init__(self) -> None:
        if self.sm_count < 1:
            raise ConfigError("gpu.sm_count", f"must be >= 1, got {self.sm_count}")
        for name in ("peak_tflops", "peak_bandwidth_gbs", "saturation_sms", "knee"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"gpu.{name}", f"must be > 0, got {getattr(self, name)}")

    def _g(self, sms: float) -> float:
        x = sms / self.saturation_sms
        return x / (1.0 + x ** self.knee) ** (1.0 / self.knee)

    def compute_flops_per_s(self, sms: float) -> float:
        """FLOP/s on `sms` SMs (proportional to the SMs)."""
        return self.peak_tflops * 1e12 * min(max(sms, 1e-9), self.sm_count) / self.sm_count

    def bandwidth_bytes_per_s(self, sms: float) -> float:
        """Bytes/s on `sms` SMs (grows, then saturates; the whole device reaches peak_bandwidth_gbs)."""
        n = min(max(sms, 1e-9), self.sm_count)
        return self.peak_bandwidth_gbs * 1e9 * self._g(n) / self._g(self.sm_count)

    def ridge_intensity(self, sms: float) -> float:
        """FLOPs per byte above which a kernel on `sms` SMs is compute-bound."""
        return self.compute_flops_per_s(sms) / self.bandwidth_bytes_per_s(sms)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GpuSpec:
        try:
            return cls(name=str(d["name"]), sm_count=int(d["sm_count"]), peak_tflops=float(d["peak_tflops"]),
                       peak_bandwidth_gbs=float(d["peak_bandwidth_gbs"]),
                       saturation_sms=float(d["saturation_sms"]), knee=float(d.get("knee", 2.0)))
        except KeyError as e:
            raise ConfigError(f"gpu.{e.args[0]}", "missing from the profile's gpu section") from None


def roofline_time_s(flops: float, num_bytes: float, sms: float, gpu: GpuSpec) -> float:
    """Seconds a kernel of `flops` and `num_bytes` takes on `sms` SMs at the ceilings (no efficiency loss)."""
    if flops < 0 or num_bytes < 0:
        raise ConfigError("kernel", f"flops and bytes must be >= 0, got {flops}, {num_bytes}")
    return max(flops / gpu.compute_flops_per_s(sms), num_bytes / gpu.bandwidth_bytes_per_s(sms))


# The H100 SXM of GPU.md (benchmarks/results/sm_partition_h100.json, gpu_engine_speed_h100.json): bf16 GEMM
# 8192^3 at 784 TFLOP/s; decode-like GEMV 2616 GB/s on the whole GPU; the bandwidth curve fitted to the
# GEMV on 8..132 SMs. The defaults when no profile matches a GPU that says it has 132 SMs.
H100_SXM = GpuSpec(name="NVIDIA H100 80GB HBM3", sm_count=132, peak_tflops=784.0, peak_bandwidth_gbs=2616.0,
                   saturation_sms=28.5, knee=1.9)


def default_gpu_spec(name: str, sm_count: int) -> GpuSpec:
    """A roofline for a device without a profile: the H100's ceilings scaled by its SM count (a guess the
    online correction then fixes; the engine logs a warning when it falls back to this)."""
    if sm_count <= 1:
        return GpuSpec(name=name or "cpu", sm_count=1, peak_tflops=0.2, peak_bandwidth_gbs=20.0,
                       saturation_sms=0.5, knee=2.0)
    share = sm_count / H100_SXM.sm_count
    return GpuSpec(name=name, sm_count=sm_count, peak_tflops=H100_SXM.peak_tflops * share,
                   peak_bandwidth_gbs=H100_SXM.peak_bandwidth_gbs * min(1.0, share),
                   saturation_sms=H100_SXM.saturation_sms * share, knee=H100_SXM.knee)
