"""One tokenizer interface over a `tokenizers.Tokenizer`, whether it came from a Hugging Face folder or was
rebuilt from GGUF metadata, plus the model's chat template and special tokens."""

from __future__ import annotations

import functools
from typing import Any

import tokenizers

from jaxllm.tokenizer.chat_template import ChatTemplate

# Texts at least this long are tokenized with the GIL released (a server tokenizes them on a worker thread).
LONG_TEXT_CHARS = 16_384


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None):
        self.backend = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        bos = tok.id_to_token(bos_token_id) if bos_token_id is not None else ""
        eos = tok.id_to_token(eos_token_ids[0]) if eos_token_ids else ""
        self.chat_template = ChatTemplate(chat_template, bos_token=bos or "", eos_token=eos or "") \
            if chat_template else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized on a server's
        # worker thread then stalls neither the other requests nor the engine thread. A short one keeps the GIL:
        # taking it back can wait a whole switch interval (5 ms) behind a busy engine thread, for 30 us of work.
        if len(text) < LONG_TEXT_CHARS:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_pair(self, text: str, pair: str) -> list[int]:
        """Two texts as one input, joined by the tokenizer's own template (``[CLS] a [SEP] b [SEP]``): what a
        cross-encoder scores."""
        return self.backend.encode_batch([(text, pair)])[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The longest text one token decodes to, in UTF-8 bytes: a text longer than max_model_len times this
        (with slack for normalizers) cannot fit, whatever it tokenizes to."""
        return max(len(self.backend.decode([i], skip_special_tokens=False).encode()) for i in range(self.vocab_size))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def set_chat_template(self, source: str) -> None:
        """Replaces the model's chat template (e.g. with one that renders tools)."""
        bos = self.backend.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.backend.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""
        self.chat_template = ChatTemplate(source, bos_token=bos or "", eos_token=eos or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tokenize: bool = False, **kwargs: Any) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use a plain prompt")
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        # The template writes the special tokens itself.
        return self.encode(text, add_special_tokens=False) if tokenize else text
