"""Hugging Face checkpoint folders: config.json plus one or many ``*.safetensors`` files (with an index)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from safetensors import safe_open

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.loading.errors import LoadError
from jaxllm.models.registry import UnsupportedArchitectureError


def read_config_json(folder: Path, what: str = "a Hugging Face checkpoint folder") -> dict:
    """config.json of `folder`, as a dict; LoadError (one line) when it is missing or not JSON."""
    path = folder / "config.json"
    if not path.is_file():
        raise LoadError(f"{folder}: not {what} (no config.json)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LoadError(f"{path}: invalid JSON ({e})") from None


def load_hf_config(folder: Path) -> ModelConfig:
    raw = read_config_json(folder)
    path = folder / "config.json"
    try:
        return ModelConfig.from_hf(raw)
    except (ConfigError, UnsupportedArchitectureError) as e:
        raise LoadError(f"{path}: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise LoadError(f"{index}: not a safetensors index ({e})") from None
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise LoadError(f"{index}: lists {f.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{folder}: no *.safetensors files")
    return files


def hf_tensors(folder: Path) -> Iterator[tuple[str, object, str]]:
    """Yields (name, load() -> numpy array, file) for every tensor. Each file stays open while a load() of it
    exists (loads may run after the generator moved on: see `weights._prefetched`)."""
    for file in safetensors_files(folder):
        try:
            f = safe_open(str(file), framework="numpy")
            names = list(f.keys())
        except Exception as e:
            raise LoadError(f"{file}: not a valid safetensors file ({e})") from None
        for name in names:
            def load(window=None, f=f, name=name, file=file):
                """The tensor, or only its `window` (a tuple of slices: safetensors reads just those bytes)."""
                try:
                    return f.get_tensor(name) if window is None else f.get_slice(name)[window]
                except Exception as e:  # safetensors raises its own error types
                    raise LoadError(f"{file}: cannot read tensor {name!r} ({e})") from None
            load.windowed = True
            yield name, load, str(file)
