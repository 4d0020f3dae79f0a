"""Tokenizer of a Hugging Face folder: ``tokenizer.json`` plus ``tokenizer_config.json`` (special tokens and
chat template) or ``chat_template.jinja``."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from jaxllm.loading.errors import LoadError
from jaxllm.tokenizer.tokenizer import Tokenizer


def _token_str(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def tokenizer_from_hf_folder(folder: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise LoadError(f"{folder}: no tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:
        raise LoadError(f"{path}: cannot load tokenizer ({e})") from None
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: use the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja_file = folder / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    bos = _token_str(cfg.get("bos_token"))
    eos = _token_str(cfg.get("eos_token"))
    eos_ids = eos_token_ids or ((tok.token_to_id(eos),) if eos and tok.token_to_id(eos) is not None else ())
    return Tokenizer(tok, bos_token_id=tok.token_to_id(bos) if bos else None, eos_token_ids=eos_ids,
                     chat_template=template)
