"""The decoder families jaxllm runs, keyed by their Hugging Face `architectures` name: each is one module of
`jaxllm.models.families` (its `SPEC`) and one line of `FAMILIES` below. (Encoders and vision-language models
have their own tables: `jaxllm.models.encoder`, `jaxllm.models.qwen_vl`.)"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

from jaxllm.models.family import FamilySpec

FAMILIES = (
    "gemma2",
    "gemma3",
    "gpt_oss",
    "llama",
    "mistral",
    "mixtral",
    "phi3",
    "qwen2",
    "qwen2_moe",
    "qwen3",
    "qwen3_moe",
)

ARCHITECTURES: dict[str, FamilySpec] = {}


def register(spec: FamilySpec) -> FamilySpec:
    """Adds a family (the listed ones are added at import; a test or a plugin may add its own)."""
    if ARCHITECTURES.get(spec.architecture, spec) != spec:
        raise ValueError(f"{spec.architecture} is registered already, as another family")
    ARCHITECTURES[spec.architecture] = spec
    return spec


@contextlib.contextmanager
def registered(spec: FamilySpec) -> Iterator[FamilySpec]:
    """The family registered for a while (a test's own)."""
    register(spec)
    try:
        yield spec
    finally:
        ARCHITECTURES.pop(spec.architecture, None)


for _name in FAMILIES:
    register(importlib.import_module(f"jaxllm.models.families.{_name}").SPEC)


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_spec(name: str) -> FamilySpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None


def gguf_architectures() -> dict[str, str]:
    """GGUF `general.architecture` -> the Hugging Face architecture its files load as by default (the first family
    registered for it without a `gguf_when` test: Llama's for "llama", which Mistral's files share)."""
    out: dict[str, str] = {}
    for spec in ARCHITECTURES.values():
        if spec.gguf_arch is not None and spec.gguf_when is None:
            out.setdefault(spec.gguf_arch, spec.architecture)
    return out


def gguf_spec(arch: str, metadata) -> FamilySpec | None:
    """The family a GGUF file of `arch` with `metadata` loads as: the first whose `gguf_when` holds, else the
    default (`gguf_architectures`); None if no family reads `arch`."""
    for spec in ARCHITECTURES.values():
        if spec.gguf_arch == arch and spec.gguf_when is not None and spec.gguf_when(metadata):
            return spec
    default = gguf_architectures().get(arch)
    return None if default is None else ARCHITECTURES[default]
