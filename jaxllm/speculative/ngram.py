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


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None):
        self.k = config.num_speculative_tokens
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        return self.lookup(seq.token_ids, max_drafts)

    def propose_after(self, seq: Sequence, gained: list[int], max_drafts: int) -> list[int]:
        return self.lookup(seq.token_ids + gained, max_drafts)

    def worth_waiting(self, seq: Sequence) -> bool:
        """The sequence is quoting: given its tokens but the last, the lookup would have proposed its last token
        (so drafts after the next token will likely be kept too). Otherwise running ahead saves more than drafts
        that would mostly be rejected."""
        return seq.num_output_tokens > 0 and self.lookup(seq.token_ids[:-1], 1) == seq.token_ids[-1:]

    def lookup(self, token_ids: list[int], max_drafts: int) -> list[int]:
        k = min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0 or length < self.n_min + 1:
            return []
        tokens = np.asarray(token_ids, np.int64)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = tokens[-n:]
            # windows [i, i + n) that end before the suffix starts, latest first: the likeliest continuation
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start:start + k].tolist()
        return []
