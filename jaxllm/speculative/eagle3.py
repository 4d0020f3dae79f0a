"""EAGLE-3 (vLLM's "eagle3" method): a one-layer head (`eagle3_head`) drafts from the target's own hidden states.

Every target step keeps, per token, its residual stream entering three of its layers in a feature cache at the
token's KV slot (`ModelRunner.features`; the features live and die with the KV). The head keeps paged KV of its
own with the target's page ids, one row per position: row p reads the target's features at p and the token at
p + 1, so a sequence of n tokens whose n - 1 first the target computed has rows 0..n - 2, the last of which
predicts the first draft. Drafting then feeds each draft back with the head's own hidden state, on device, as a
draft model does (`draft_runner`); those rows are written over once the target computed the positions, so after
a step the head holds the rows up to the sequence's length before it (`rows_after`) and the next draft step reads
the kept drafts' rows and the target's token (at most k + 1) before drafting again.

A row at the last slot of a page reads the token after the page: where two sequences share that page (a prefix
cache hit, samples of one prompt), the row is the last writer's. Drafts read it; the output, verified by the
target, does not depend on drafts."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.config import ConfigError
from jaxllm.speculative.draft_model import DraftModelProposer
from jaxllm.speculative.draft_runner import DraftInputs, DraftRunner, decode_step, decode_trips
from jaxllm.speculative.methods import ProposerContext


def _features(features: jax.Array, inputs: DraftInputs) -> jax.Array:
    """Each row's target features [T, F]: at its own position's KV slot (padding rows read slot 0)."""
    return features[jnp.maximum(inputs.meta.slot_mapping, 0)]


def catch_up_function(graphdef, state_def, params, caches, features, inputs: DraftInputs):
    head = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    _, _, caches = head.forward_paged(inputs.ids, inputs.positions, caches, inputs.meta, _features(features, inputs),
                                      project=True)
    return caches


def draft_function(graphdef, state_def, k: int, argmax, params, caches, features, inputs: DraftInputs):
    """-> (caches, drafts [S, k] i32 target ids): the last rows' drafts, then each fed back with the hidden state
    the head computed for it (`decode_step`)."""
    head = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    normed, hidden, caches = head.forward_paged(inputs.ids, inputs.positions, caches, inputs.meta,
                                                _features(features, inputs), project=True)
    rows = inputs.last_rows
    first = head.to_target(argmax(head.logits(normed[rows])))  # [S]

    def decode(j, carry):
        caches, token, hidden, drafts = carry
        positions, step = decode_step(inputs, j, caches[0].shape[2])
        normed, hidden, caches = head.forward_paged(token, positions, caches, step, hidden, project=False)
        token = head.to_target(argmax(head.logits(normed)))
        return caches, token, hidden, drafts.at[:, j].set(token)

    drafts = jnp.zeros((first.shape[0], k), jnp.int32).at[:, 0].set(first)
    caches, _, _, drafts = jax.lax.fori_loop(1, decode_trips(inputs, k), decode, (caches, first, hidden[rows], drafts))
    return caches, drafts


class Eagle3Runner(DraftRunner):
    def __init__(self, *args, features: Callable[[], jax.Array], **kwargs):
        """features: the target's feature cache as it is now (`ModelRunner.features`)."""
        self.target_features = features
        super().__init__(*args, **kwargs)

    catch_up_function = staticmethod(catch_up_function)
    draft_function = staticmethod(draft_function)

    def extra(self) -> tuple:
        return (self.target_features(),)


class Eagle3Proposer(DraftModelProposer):
    shift = 1  # row p reads the token at p + 1 (beside the target's features at p)

    def make_runner(self, context: ProposerContext) -> DraftRunner:
        if context.target_features is None:
            raise ConfigError("speculative_config: eagle3 runs in an engine whose steps keep the head's features")
        # after a step that kept every draft, the next reads k + 1 rows: the kept drafts' and the target's token
        return Eagle3Runner(context.draft, k=self.k, num_pages=context.num_pages, page_size=context.page_size,
                            max_model_len=context.max_model_len, buckets=list(context.buckets),
                            kv_cache_dtype=context.kv_cache_dtype, mesh=context.mesh, tail=self.k + 1,
                            features=context.target_features)

    def rows_after(self, rows: int, drafts: int, rejected: int) -> int:
        return rows  # the drafts' rows hold the head's hidden states, not the target's: read again
