"""Read a Hugging Face model folder: config.json and safetensors weights (one file or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import torch

from bullet_ray.errors import ModelLoadError


def read_config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{folder!r} has no config.json; pass a Hugging Face model folder, a .gguf "
                             "file, dummy:<preset>, or 'smollm2-135m-instruct'")
    with open(path) as f:
        return json.load(f)


def safetensors_files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, n) for n in names]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        raise ModelLoadError(f"{folder!r} has no .safetensors weights")
    return [os.path.join(folder, f) for f in files]


def iter_safetensors(files: list[str], show_progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    from tqdm import tqdm

    names = []
    for path in files:
        with safe_open(path, framework="pt") as f:
            names += [(path, k) for k in f.keys()]  # noqa: SIM118 - safe_open is not a mapping
    handles: dict[str, object] = {}
    try:
        for path, key in tqdm(names, desc="loading weights", disable=not show_progress, unit="tensor"):
            if path not in handles:
                handles[path] = safe_open(path, framework="pt").__enter__()
            yield key, handles[path].get_tensor(key)  # type: ignore[attr-defined]
    finally:
        handles.clear()


def has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer.model",
                                                                 "tokenizer_config.json"))
