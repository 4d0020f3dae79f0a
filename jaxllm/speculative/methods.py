"""The speculative methods by name: what `SpeculativeConfig.method` may say. A method is a `Proposer` made from the
config and what the engine lends it (`ProposerContext`); adding one is a file and a line here."""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    import jax

    from jaxllm.engine.scheduler import ScheduledStep
    from jaxllm.engine.sequence import Sequence
    from jaxllm.models.protocol import Model
    from jaxllm.speculative.config import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class ProposerContext:
    """What the engine lends a method: its cache geometry (a draft model keeps its own KV in pages of the same
    ids as the target's, so the target's block tables serve both), its step shapes, and a draft model loaded
    beside the target (`engine_parts`), or the target's features an EAGLE-3 head reads (`ModelRunner.features`)."""
    max_model_len: int
    page_size: int = 16
    num_pages: int = 0
    buckets: tuple[tuple[int, int], ...] = ()  # the target's (tokens, sequences) step shapes
    draft: Model | None = None
    kv_cache_dtype: object = None  # the draft's cache element type
    mesh: jax.sharding.Mesh | None = None
    target_features: Callable[[], jax.Array] | None = None


class Proposer:
    """A speculative method. Each step, before the scheduler runs, `propose` says each decoding sequence's drafts;
    the scheduler counts them in the token budget and gives them pages; `fill` may then compute them (a method that
    runs a model needs those pages first: its `propose` returns placeholders of the length it will fill); after
    the target verified them, `observe` learns how many each sequence kept."""

    def begin(self, running: list[Sequence]) -> None:
        """A new step's proposals start; `running` holds every sequence that may still be asked about."""

    def propose(self, seq: Sequence, max_drafts: int) -> list[int]:
        """Up to `max_drafts` (>= 1) tokens guessed to follow `seq`'s prompt and output so far; fewer, or none,
        when there is no good guess."""
        raise NotImplementedError

    def propose_after(self, seq: Sequence, gained: list[int], max_drafts: int) -> list[int] | None:
        """`propose` for `seq` had it `gained` these tokens more, on the host and at once (a step dispatched before
        the one it follows is read back: `Drafter.guess`); None: the method cannot (it runs a model)."""
        return None

    def fill(self, step: ScheduledStep) -> None:
        """The step's drafts (`step.drafts`, as scheduled) made final, in place."""

    def observe(self, step: ScheduledStep, rejected: list[int]) -> None:
        """The target verified `step`: per sequence, how many of its drafts it rejected."""

    def worth_waiting(self, seq: Sequence) -> bool:
        """Whether `seq`'s next step should wait for this one's token to draft from it, rather than run ahead
        without drafts (async scheduling)."""
        return False

    def warmup(self) -> None:
        """Builds what the method runs, so that nothing compiles while serving."""


# name -> "module:class"; imported when used (a draft model's runner pulls in the engine's step machinery)
METHODS: dict[str, str] = {
    "ngram": "jaxllm.speculative.ngram:NgramProposer",
    "draft_model": "jaxllm.speculative.draft_model:DraftModelProposer",
    "eagle3": "jaxllm.speculative.eagle3:Eagle3Proposer",
}
MODEL_METHODS = frozenset({"draft_model", "eagle3"})  # methods that load a model of their own (`.model`)


def make_proposer(config: SpeculativeConfig, context: ProposerContext) -> Proposer:
    module, _, name = METHODS[config.method].partition(":")
    return getattr(importlib.import_module(module), name)(config, context)
