"""Verification of a step's drafts on the host, and the counters vLLM reports for it.

The target samples every position of a drafted sequence (its last token and each draft) with the key of the token
index it would sample there in a plain step. Position j's sample is that plain step's token whenever drafts
0..j-1 were right, so keeping the samples up to and including the first that differs from its draft gives the
plain output exactly: for a draft that is a guess (n-gram) this is rejection sampling with a point-mass proposal
(a draft d is kept with probability p(d), otherwise the sample comes from p restricted to the other tokens)."""

from __future__ import annotations

import dataclasses

import numpy as np


def accepted(samples: np.ndarray, drafts: list[int]) -> list[int]:
    """samples [>= len(drafts) + 1]: the target's tokens at a sequence's sample positions -> the tokens it gets:
    its drafts up to the first the target disagrees with, then the target's own token there (or after the last)."""
    out = []
    for j, token in enumerate(samples[:len(drafts) + 1].tolist()):
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out


@dataclasses.dataclass
class SpecDecodeStats:
    """vLLM's spec-decode counters: drafts (sequences that had drafts in a step), draft tokens, accepted tokens,
    and accepted tokens by draft position."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = dataclasses.field(default_factory=list)
    # jaxllm's own: drafted steps dispatched on a guess of the step before's tokens (`Drafter.guess`), and those
    # whose guess held (the others' results were dropped)
    num_guessed_steps: int = 0
    num_guessed_steps_held: int = 0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos.extend([0] * (num_drafted - len(self.accepted_per_pos)))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def observe_guess(self, held: bool) -> None:
        self.num_guessed_steps += 1
        self.num_guessed_steps_held += held

    def counters(self) -> dict:
        """As the engine's stats publish them (metric names without their jaxllm_ prefix)."""
        return {"spec_decode_num_drafts_total": self.num_drafts,
                "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
                "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
                "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
                "spec_decode_num_guessed_steps_total": self.num_guessed_steps,
                "spec_decode_num_guessed_steps_held_total": self.num_guessed_steps_held}

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafted sequence got per step on average (its accepted drafts plus the target's own)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
