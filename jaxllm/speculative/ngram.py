"""Prompt lookup (vLLM's "ngram" method): the sequence's last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) are looked up earlier in its prompt and output; the tokens that followed their latest earlier
occurrence are the drafts. Free to propose (no model runs), and right whenever the output quotes its input:
repeating, rewriting, extracting, editing code."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from jaxllm.speculative.methods import Proposer, ProposerContext

if TYPE_CHECKING:
    from jaxllm.engine.sequence import Sequence
    from jaxllm.speculative.config import SpeculativeConfig


_EMPTY = (np.empty(0, np.int32), 0)  # a sequence not seen yet: no buffer, no tokens


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None):
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min
        # Each running sequence's tokens as an int32 array (buffer, tokens in it), appended to as the sequence
        # grows (its tokens are only ever appended): a list's conversion costs a lookup O(length) Python work
        self._arrays: dict[int, tuple[np.ndarray, int]] = {}

    def begin(self, running: list[Sequence]) -> None:
        self._arrays = {seq.seq_id: a for seq in running if (a := self._arrays.get(seq.seq_id)) is not None}

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return self._lookup(self._tokens(seq), max_drafts)

    def propose_after(self, seq: Sequence, gained: list[int], max_drafts: int) -> list[int]:
        return self._lookup(np.concatenate((self._tokens(seq), np.asarray(gained, np.int32))), max_drafts)

    def worth_waiting(self, seq: Sequence) -> bool:
        """The sequence is quoting: given its tokens but the last, the lookup would have proposed its last token
        (so drafts after the next token will likely be kept too). Otherwise running ahead saves more than drafts
        that would mostly be rejected."""
        tokens = self._tokens(seq)
        return seq.num_output_tokens > 0 and self._lookup(tokens[:-1], 1) == tokens[-1:].tolist()

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """The drafts that follow `token_ids`: what followed the latest earlier occurrence of their last n tokens,
        n from prompt_lookup_max down to prompt_lookup_min (the first n with one wins)."""
        return self._lookup(np.asarray(token_ids, np.int32), max_drafts)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        ids = seq.token_ids
        buffer, filled = self._arrays.get(seq.seq_id, _EMPTY)
        if filled < len(ids):
            if len(ids) > buffer.size:
                buffer = np.concatenate((buffer[:filled], np.empty(max(buffer.size, len(ids) + 64 - filled), np.int32)))
            buffer[filled:len(ids)] = ids[filled:]
            self._arrays[seq.seq_id] = buffer, len(ids)
        return buffer[:len(ids)]

    def _lookup(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """`lookup` on an int32 array. A window [i, i + n) of the tokens before the last that equals the last n
        tokens ends with the last token, so the candidates are the earlier positions of the last token (one
        comparison over the array), checked n - 1 tokens back, all at once."""
        k = min(self.k, max_drafts)
        length = tokens.size
        if k <= 0 or length < self.n_min + 1:
            return []
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # the last token of each candidate window
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            at = ends[ends >= n - 1]
            match = np.ones(at.size, bool)
            for back in range(1, n):
                match &= tokens[at - back] == tokens[length - 1 - back]
            hits = at[match]
            if hits.size:  # the latest: likeliest to continue as the sequence will
                start = int(hits[-1]) + 1
                return tokens[start:start + k].tolist()
        return []
