"""Rebuilds a GGUF file's tokenizer from its metadata with the `tokenizers` library: byte-level BPE ('gpt2')
following llama.cpp's pre-tokenizer rules for the ``tokenizer.ggml.pre`` name; a SentencePiece vocabulary
('llama': Llama 2, Mistral, Phi-3 files) through transformers' GGUF tokenizer converter, which recovers the
merges from the vocabulary's scores."""

from __future__ import annotations

from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from jaxllm.loading.errors import LoadError
from jaxllm.tokenizer.tokenizer import Tokenizer

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        return None
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _sentencepiece(meta: dict[str, Any], source: str) -> Tokenizer:
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError as e:  # an internal module of transformers: say which one moved
        raise LoadError(f"{source}: a SentencePiece GGUF vocabulary needs transformers' GGUF tokenizer converter "
                        f"(transformers.integrations.gguf.gguf_tokenizer_mapping): {e}") from None
    names = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {name: meta[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in meta}
    spec = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in spec.items()}
    tok, _ = convert_gguf_tokenizer(meta.get("general.architecture", "llama"), spec)
    tok.post_processor = None  # the file's add_bos_token decides, below
    return _wrap(tok, meta, spec["tokens"], add_bos_default=True)  # SentencePiece files: BOS unless they say not


def _wrap(tok: HFTokenizer, meta: dict[str, Any], tokens: list[str], *, add_bos_default: bool) -> Tokenizer:
    """The backend with the file's BOS (prepended when `tokenizer.ggml.add_bos_token` says so), EOS and chat
    template."""
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    if bos is not None and meta.get("tokenizer.ggml.add_bos_token", add_bos_default):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
    return Tokenizer(tok, bos_token_id=bos, eos_token_ids=(eos,) if eos is not None else (),
                     chat_template=meta.get("tokenizer.chat_template"))


def tokenizer_from_gguf(meta: dict[str, Any], source: str) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece(meta, source)
    if kind != "gpt2":
        raise LoadError(f"{source}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' and "
                        f"SentencePiece 'llama')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    pre_tok = _pre_tokenizer(pre)
    if pre_tok is None:
        raise LoadError(f"{source}: pre-tokenizer {pre!r} is not supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = np.asarray(meta.get("tokenizer.ggml.token_type", np.ones(len(tokens))))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED)])
    return _wrap(tok, meta, tokens, add_bos_default=False)
