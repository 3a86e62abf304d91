"""A performance profile: one (device, model, dtype)'s roofline ceilings, measured steps and fitted factors.

`bullet-ray profile` writes one JSON file per (device, model); the engine loads the one matching its GPU
name, model architecture and dtype at start (`find_profile`), or falls back to the roofline defaults.
Schema (version 1), every field checked on load with errors naming it:

    {"schema_version": 1, "kind": "bullet_ray.perf_profile",
     "date": "...", "command": "...", "source": "measured" | "derived", "notes": "...",
     "gpu":   {"name", "sm_count", "peak_tflops", "peak_bandwidth_gbs", "saturation_sms", "knee"},
     "model": {"name", "architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"},
     "dtype": "bfloat16",
     "ladder": [16, 24, ...],              # decode SM counts of the ladder the sweep ran on
     "calibration": {"prefill": {...}, "decode": {...}},     # bullet_ray.perf.calibration.factors
     "fit": {"median_rel_error": ..., "p90_rel_error": ..., "num_samples": ...},
     "samples": [{"phase", "num_tokens", "num_seqs", "num_context_tokens", "num_attention_pairs",
                  "sms", "other_busy", "measured_s"}, ...]}

Profiles shipped with the package live in bullet_ray/perf/profiles/; BULLET_RAY_PROFILE_DIR adds a folder
searched first. Pure Python.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bullet_ray.errors import ConfigError
from bullet_ray.models.config import ModelConfig
from bullet_ray.perf.calibration.factors import Calibration
from bullet_ray.perf.kernels import PHASES, Phase, StepShape
from bullet_ray.perf.roofline import GpuSpec

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1
KIND = "bullet_ray.perf_profile"
PACKAGE_DIR = Path(__file__).parent / "profiles"
FINGERPRINT_FIELDS = ("architecture", "hidden_size", "intermediate_size", "num_hidden_layers",
                      "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")


def model_fingerprint(cfg: ModelConfig) -> dict[str, Any]:
    """What makes two models run at the same speed (weights do not matter: dummy = real)."""
    return {name: getattr(cfg, name) for name in FINGERPRINT_FIELDS}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class Sample:
    """One measured step of the sweep."""

    phase: Phase
    num_tokens: int
    num_seqs: int
    num_context_tokens: int
    num_attention_pairs: int
    sms: int  # SMs the step ran on
    other_busy: bool  # the other side ran at the same time
    measured_s: float

    @property
    def shape(self) -> StepShape:
        return StepShape(self.phase, self.num_tokens, self.num_seqs, self.num_context_tokens,
                         self.num_attention_pairs)

    def to_dict(self) -> dict[str, Any]:
        return {"phase": self.phase, "num_tokens": self.num_tokens, "num_seqs": self.num_seqs,
                "num_context_tokens": self.num_context_tokens, "num_attention_pairs": self.num_attention_pairs,
                "sms": self.sms, "other_busy": self.other_busy, "measured_s": self.measured_s}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> Sample:
        try:
            phase = d["phase"]
            if phase not in PHASES:
                raise ConfigError(f"{where}.phase", f"unknown phase {phase!r}; choose one of {PHASES}")
            sample = cls(phase, int(d["num_tokens"]), int(d["num_seqs"]), int(d["num_context_tokens"]),
                         int(d["num_attention_pairs"]), int(d["sms"]), bool(d["other_busy"]),
                         float(d["measured_s"]))
        except KeyError as e:
            raise ConfigError(f"{where}.{e.args[0]}", "missing") from None
        if sample.measured_s <= 0 or sample.sms < 1:
            raise ConfigError(where, f"measured_s must be > 0 and sms >= 1, got {d}")
        sample.shape  # validates the counts  # noqa: B018
        return sample


@dataclass(frozen=True)
class Profile:
    gpu: GpuSpec
    model: dict[str, Any]  # "name" plus the fingerprint fields
    dtype: str
    ladder: list[int]
    calibration: Calibration
    samples: list[Sample] = field(default_factory=list)
    date: str = ""
    command: str = ""
    source: str = "measured"  # "measured" by `bullet-ray profile`, or "derived" from other measurements
    notes: str = ""
    fit: dict[str, Any] = field(default_factory=dict)

    def matches(self, gpu_name: str, cfg: ModelConfig, dtype: str) -> bool:
        fp = model_fingerprint(cfg)
        return (slug(self.gpu.name) == slug(gpu_name) and self.dtype == dtype
                and all(self.model.get(k) == v for k, v in fp.items()))

    @property
    def file_name(self) -> str:
        return f"{slug(self.gpu.name)}__{slug(str(self.model.get('name', 'model')))}__{self.dtype}.json"

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "kind": KIND, "date": self.date, "command": self.command,
                "source": self.source, "notes": self.notes, "gpu": self.gpu.to_dict(), "model": self.model,
                "dtype": self.dtype, "ladder": self.ladder, "calibration": self.calibration.to_dict(),
                "fit": self.fit, "samples": [s.to_dict() for s in self.samples]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("kind") != KIND:
            raise ConfigError("kind", f"not a bullet_ray profile (kind {d.get('kind')!r}, want {KIND!r})")
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ConfigError("schema_version", f"profile schema {d.get('schema_version')!r} is not "
                              f"{SCHEMA_VERSION}; re-run `bullet-ray profile`")
        for key in ("gpu", "model", "dtype", "ladder", "calibration"):
            if key not in d:
                raise ConfigError(key, "missing from the profile")
        model = d["model"]
        missing = [k for k in FINGERPRINT_FIELDS if k not in model]
        if missing:
            raise ConfigError(f"model.{missing[0]}", "missing from the profile")
        ladder = d["ladder"]
        if not isinstance(ladder, list) or not ladder or any(not isinstance(c, int) or c < 1 for c in ladder):
            raise ConfigError("ladder", f"need a non-empty list of SM counts >= 1, got {ladder!r}")
        samples = [Sample.from_dict(s, f"samples[{i}]") for i, s in enumerate(d.get("samples", []))]
        return cls(GpuSpec.from_dict(d["gpu"]), dict(model), str(d["dtype"]), list(ladder),
                   Calibration.from_dict(d["calibration"]), samples, str(d.get("date", "")),
                   str(d.get("command", "")), str(d.get("source", "measured")), str(d.get("notes", "")),
                   dict(d.get("fit", {})))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write the profile as JSON (a folder: under its file_name); returns the file written."""
    p = Path(path)
    if p.is_dir():
        p = p / profile.file_name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(profile.to_dict(), indent=1) + "\n")
    return p


def load_profile(path: str | os.PathLike[str]) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError("profile", f"no profile at {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError("profile", f"{path} is not JSON: {e}") from None
    return Profile.from_dict(data)


def search_dirs() -> list[Path]:
    extra = os.environ.get("BULLET_RAY_PROFILE_DIR")
    return ([Path(extra)] if extra else []) + [PACKAGE_DIR]


def find_profile(gpu_name: str, cfg: ModelConfig, dtype: str, dirs: list[Path] | None = None) -> Profile | None:
    """The first profile (BULLET_RAY_PROFILE_DIR, then the package's) for this device, model and dtype."""
    for folder in dirs if dirs is not None else search_dirs():
        for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                profile = load_profile(path)
            except ConfigError as e:
                logger.warning("skipping profile %s: %s", path, e)
                continue
            if profile.matches(gpu_name, cfg, dtype):
                return profile
    return None
