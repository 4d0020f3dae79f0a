"""The speculative methods by name: what `SpeculativeConfig.method` may say. A method is a class made from the
config that proposes draft tokens for a sequence (`Proposer`); adding one is a file and a line here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from jaxllm.speculative.ngram import NgramProposer

if TYPE_CHECKING:
    from jaxllm.speculative.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to `max_drafts` tokens guessed to follow `token_ids` (a sequence's prompt and output so far); the
        target model verifies them in its next step. Fewer, or none, when there is no good guess."""


METHODS: dict[str, type] = {"ngram": NgramProposer}


def make_proposer(config: SpeculativeConfig) -> Proposer:
    return METHODS[config.method](config)
