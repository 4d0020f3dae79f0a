"""Hugging Face folders of Qwen2.5-VL and Qwen3-VL: the language model's tensors go through the decoder's loader
(renamed to its layout: transformers 5's ``model.language_model.*`` or the flat ``model.*``), the vision encoder's
(``visual.*`` or ``model.visual.*``) into `QwenVisionEncoder` / `Qwen3VisionEncoder`."""

from __future__ import annotations

import json
from pathlib import Path

from jax.sharding import Mesh

from jaxllm.config import ConfigError
from jaxllm.kernels import Kernels
from jaxllm.loading.errors import LoadError
from jaxllm.loading.hf import hf_tensors
from jaxllm.loading.weights import ReadStats, assemble_model
from jaxllm.models.qwen3_vision import Qwen3VisionConfig, Qwen3VisionEncoder, qwen3_vision_parameter_names
from jaxllm.models.qwen_vision import QwenVisionEncoder, load_vision_arrays
from jaxllm.models.qwen_vl import VL_ARCHITECTURES, QwenVLForConditionalGeneration, VLConfig

VISION_PREFIXES = ("model.visual.", "visual.")


def is_vl_folder(folder: Path) -> bool:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(raw.get("architectures")) and raw["architectures"][0] in VL_ARCHITECTURES


def vl_eos_token_ids(folder: Path) -> tuple[int, ...]:
    try:
        return VLConfig.from_hf(json.loads((folder / "config.json").read_text())).text.eos_token_ids
    except ConfigError as e:
        raise LoadError(f"{folder}/config.json: {e}") from None


def load_qwen_vl(folder: Path, *, dtype, kernels: Kernels, mesh: Mesh,
                 read_stats: ReadStats | None = None) -> QwenVLForConditionalGeneration:
    try:
        cfg = VLConfig.from_hf(json.loads((folder / "config.json").read_text()))
    except ConfigError as e:
        raise LoadError(f"{folder}/config.json: {e}") from None
    vision: dict = {}

    def language_tensors():
        for name, load, source in hf_tensors(folder):
            prefix = next((p for p in VISION_PREFIXES if name.startswith(p)), None)
            if prefix is not None:
                vision[name[len(prefix):]] = load()
            else:
                yield name.replace("model.language_model.", "model.", 1), load, source

    language = assemble_model(cfg.text, language_tensors(), dtype=dtype, kernels=kernels, mesh=mesh,
                              read_stats=read_stats)
    if isinstance(cfg.vision, Qwen3VisionConfig):
        encoder, names = Qwen3VisionEncoder(cfg.vision), qwen3_vision_parameter_names(cfg.vision)
    else:
        encoder, names = QwenVisionEncoder(cfg.vision), None
    try:
        load_vision_arrays(encoder, vision, names)
    except ConfigError as e:
        raise LoadError(f"{folder}: {e}") from None
    return QwenVLForConditionalGeneration(cfg, language, encoder)
