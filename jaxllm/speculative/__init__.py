"""Speculative decoding: a method proposes draft tokens for each decoding sequence, the target model computes all
of them in its next step, and each sequence keeps its drafts up to the first one the target's own sample differs
from, plus that sample. The sample at each position is drawn with the key of its token index, exactly as a plain
step would draw it, so the output is the one speculation-free decoding gives, token for token, at any
temperature (see `verify`)."""

from jaxllm.speculative.config import SpeculativeConfig
from jaxllm.speculative.drafter import Drafter
from jaxllm.speculative.methods import METHODS, Proposer, make_proposer
from jaxllm.speculative.verify import SpecDecodeStats

__all__ = ["METHODS", "Drafter", "Proposer", "SpecDecodeStats", "SpeculativeConfig", "make_proposer"]
