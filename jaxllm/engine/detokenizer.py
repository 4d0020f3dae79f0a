"""Incremental detokenisation with stop strings.

Each new token's text is the difference between decoding a short window of ids with and without it, so
the cost per token stays constant; text whose last character is incomplete (U+FFFD from a partial UTF-8
sequence) is held back until the next token completes it. Stop strings are searched on the text, not on
tokens; while a request streams, the last ``len(longest stop) - 1`` characters are held back so a stop
string never leaks out half-written.
"""

from __future__ import annotations

from jaxllm.tokenizer.tokenizer import Tokenizer

PROMPT_CONTEXT = 6  # prompt tokens decoded as left context (tokenizers that merge a leading space need it)


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer | None, prompt_token_ids: list[int], *, skip_special_tokens: bool,
                 stop: tuple[str, ...], include_stop_str_in_output: bool):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Appends a token; returns the stop string it completed, if any (the text is then cut there)."""
        if self.tokenizer is None:
            return None
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        start = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop:
            return None
        search_from = max(0, start - self.holdback)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[:index + len(stop) if self.include_stop else index]
        return stop

    def visible_length(self, finished: bool) -> int:
        """How much of the text may be shown so far: only ever grows (a stop string is found before any of it
        is shown, and the text is cut only there)."""
        return len(self.text) if finished else max(0, len(self.text) - self.holdback)

    def visible_text(self, finished: bool, start: int = 0) -> str:
        """The text that may be shown so far, from character `start` on (what is new since an earlier output)."""
        return self.text[start:self.visible_length(finished)]
