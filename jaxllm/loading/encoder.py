"""Hugging Face folders of BERT-family encoders (``BertModel``, ``XLMRobertaModel``, their
``*ForSequenceClassification`` cross-encoders), as sentence-transformers saves them: float weights read whole
(these models are small)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxllm.config import ConfigError
from jaxllm.loading.errors import LoadError
from jaxllm.loading.hf import hf_tensors
from jaxllm.models.encoder import (
    ENCODER_ARCHITECTURES,
    ENCODER_MODEL_TYPES,
    EncoderConfig,
    EncoderModel,
    load_encoder_arrays,
)
from jaxllm.tokenizer.hf_tokenizer import tokenizer_from_hf_folder
from jaxllm.tokenizer.tokenizer import Tokenizer


def is_encoder_folder(folder: Path) -> bool:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    archs = raw.get("architectures") or []
    return (archs[0] in ENCODER_ARCHITECTURES) if archs else raw.get("model_type") in ENCODER_MODEL_TYPES


def load_encoder(folder: Path, dtype) -> tuple[EncoderModel, Tokenizer | None]:
    raw = json.loads((folder / "config.json").read_text())
    tokenizer = tokenizer_from_hf_folder(folder) if (folder / "tokenizer.json").is_file() else None
    sep = None
    if tokenizer is not None:
        sep = next((i for t in ("[SEP]", "</s>") if (i := tokenizer.backend.token_to_id(t)) is not None), None)
    try:
        cfg = EncoderConfig.from_hf(raw, sep_token_id=sep)
        model = EncoderModel(cfg, dtype=dtype)
        load_encoder_arrays(model, {name: load() for name, load, _ in hf_tensors(folder)})
    except ConfigError as e:
        raise LoadError(f"{folder}: {e}") from None
    return model, tokenizer
