"""A draft model's steps on device, two kinds, each compiled once per bucket:
- catch-up: the draft's KV cache reads tokens it has not seen (a prompt, in chunks; a ragged batch as the target's
  steps take it, in the target's (tokens, sequences) buckets);
- draft: each drafting sequence's last one or two tokens, then k tokens drafted greedily, each decode step feeding
  the last one's argmax back in, all inside the executable: one host round trip for k drafts. Its buckets hold
  `TAIL` tokens a sequence, so its decode steps run over as few rows as there are drafting sequences.

The draft's cache has the target's page ids (`ProposerContext`): a sequence's block table, as the target's
scheduler grew it for the step (its drafts included), says where both models' KV goes. A draft's decode step
writes only positions its sequence has pages for (`room`), so no sequence's pages are touched by another's."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.engine.model_runner import abstract_array
from jaxllm.engine.sampler import argmax_for
from jaxllm.engine.step_executables import StepExecutables
from jaxllm.engine.step_options import step_compiler_options
from jaxllm.models.protocol import Model
from jaxllm.sharding import kv_cache_sharding
from pallas_kernels.kv_cache import abstract_kv_cache, allocate_kv_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftInputs:
    ids: jax.Array  # [T] i32: the tokens the draft's cache reads
    positions: jax.Array  # [T] i32
    meta: AttentionMetadata  # of those tokens; kv_lens [S]: each sequence's length once they are read
    last_rows: jax.Array  # [S] i32: each sequence's last token row (its first draft is sampled there)
    room: jax.Array  # [S] i32: drafts wanted (0: padding)


TAIL = 2  # tokens of a sequence a draft model's step reads at most: its last, and after a step that kept every draft
# the last one (never fed back); anything before them is read by a catch-up step first


def catch_up_function(graphdef, state_def, params, caches, inputs: DraftInputs):
    """-> caches holding the KV of `inputs`' tokens."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    _, caches = model.forward_paged(inputs.ids, inputs.positions, caches, inputs.meta)
    return caches


def decode_step(inputs: DraftInputs, j, page_size: int) -> tuple[jax.Array, AttentionMetadata]:
    """Decode step j (1 <= j < max(room)) of a draft step: each sequence's one row at position kv_lens + j - 1
    (where it writes draft j - 1's KV) when its room is over j; the others write nothing and read the context they
    have (at least one slot: padding reads page 0). -> (positions [S], metadata)."""
    meta = inputs.meta
    tables, ctx = meta.block_tables, meta.kv_lens
    s = ctx.shape[0]
    pos = ctx + j - 1
    live = inputs.room > j
    page_of = jnp.take_along_axis(tables, jnp.minimum(pos // page_size, tables.shape[1] - 1)[:, None], axis=1)[:, 0]
    slots = jnp.where(live, page_of * page_size + pos % page_size, -1)
    lens = jnp.where(live, pos + 1, jnp.maximum(ctx, 1))
    one_each = jnp.arange(s + 1, dtype=jnp.int32)  # every sequence one query token
    return jnp.where(live, pos, 0), AttentionMetadata(slot_mapping=slots, block_tables=tables, kv_lens=lens,
                                                      query_start_loc=one_each)


def decode_trips(inputs: DraftInputs, k: int) -> jax.Array:
    """The decode loop's end: as many steps as the longest request needs (a sequence capped by max_tokens or a
    poor record drafts fewer), not always k - 1."""
    return jnp.minimum(inputs.room.max(), k)


def draft_function(graphdef, state_def, k: int, argmax, params, caches, inputs: DraftInputs):
    """-> (caches, drafts [S, k] i32): sequence s's drafts d_0..d_{k-1}, of which its first room[s] are computed
    (decode step j feeds d_{j-1} back: `decode_step`)."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    hidden, caches = model.forward_paged(inputs.ids, inputs.positions, caches, inputs.meta)
    first = argmax(model.logits(hidden[inputs.last_rows]))  # [S]

    def decode(j, carry):
        caches, token, drafts = carry
        positions, step = decode_step(inputs, j, caches[0].shape[2])
        hidden, caches = model.forward_paged(token, positions, caches, step)
        token = argmax(model.logits(hidden))
        return caches, token, drafts.at[:, j].set(token)

    drafts = jnp.zeros((first.shape[0], k), jnp.int32).at[:, 0].set(first)
    caches, _, drafts = jax.lax.fori_loop(1, decode_trips(inputs, k), decode, (caches, first, drafts))
    return caches, drafts


Row = tuple[list[int], int, list[int], int]  # (tokens to read, the position of the first, block table, drafts)


class DraftRunner:
    """The draft model's runner; a method whose draft reads more than its own cache (an EAGLE-3 head reads the
    target's features) names its own `catch_up_function` and `draft_function` and overrides `extra` (arguments passed
    between the cache and the inputs)."""

    def __init__(self, model: Model, *, k: int, num_pages: int, page_size: int, max_model_len: int,
                 buckets: list[tuple[int, int]], kv_cache_dtype=None, mesh=None, tail: int = TAIL):
        """k: drafts a sequence gets at most; num_pages, page_size: the target's cache geometry (the draft's cache
        has the same page ids); buckets: the target's (tokens, sequences) step shapes, those of catch-up steps
        (a draft step for s sequences holds tail * s tokens)."""
        cfg = model.config
        graphdef, state = nnx.split(model)
        self.params, state_def = jax.tree.flatten(state)
        self.k, self.page_size, self.tail = k, page_size, tail
        self.catch_up_buckets = sorted(buckets)
        self.draft_buckets = sorted({(tail * s, s) for _, s in buckets})
        self.max_pages_per_seq = -(-max_model_len // page_size)
        dtype = kv_cache_dtype or model.dtype
        cache_args = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim, dtype,
                      kv_cache_sharding(mesh) if mesh is not None else None)
        self._allocate = functools.partial(allocate_kv_cache, *cache_args)
        self._caches = None
        abstract_params = [abstract_array(p) for p in self.params]
        abstract_caches = abstract_kv_cache(*cache_args)

        def abstract_args(bucket):
            inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), self.inputs([], bucket))
            return abstract_params, abstract_caches, *map(abstract_array, self.extra()), inputs

        platform = model.kernels.platform
        options = step_compiler_options(platform)
        catch_up, draft = self.functions(graphdef, state_def, argmax_for(platform))
        self.catch_up_executables = StepExecutables(jax.jit(catch_up, donate_argnums=(1,)), abstract_args, graphdef,
                                                    options, None)
        self.draft_executables = StepExecutables(jax.jit(draft, donate_argnums=(1,)), abstract_args, graphdef,
                                                 options, None)

    # catch_up(graphdef, state_def, params, caches, *extra, inputs) -> caches; draft(graphdef, state_def, k, argmax,
    # params, caches, *extra, inputs) -> (caches, drafts [S, k])
    catch_up_function = staticmethod(catch_up_function)
    draft_function = staticmethod(draft_function)

    def functions(self, graphdef, state_def, argmax):
        return (functools.partial(self.catch_up_function, graphdef, state_def),
                functools.partial(self.draft_function, graphdef, state_def, self.k, argmax))

    def extra(self) -> tuple:
        """Device arrays both kinds of step read after the cache (read when a step runs or is built)."""
        return ()

    @property
    def caches(self):
        if self._caches is None:
            self._caches = self._allocate()
        return self._caches

    @property
    def max_tokens(self) -> int:
        """Tokens one catch-up step reads at most."""
        return self.catch_up_buckets[-1][0]

    @property
    def max_seqs(self) -> int:
        """Sequences one step holds at most (either kind)."""
        return self.catch_up_buckets[-1][1]

    @staticmethod
    def _bucket(buckets: list[tuple[int, int]], rows: list[Row]) -> tuple[int, int]:
        t, s = sum(len(r[0]) for r in rows), len(rows)
        return next(b for b in buckets if b[0] >= t and b[1] >= s)

    def inputs(self, rows: list[Row], bucket: tuple[int, int]) -> DraftInputs:
        """`rows` padded to `bucket`."""
        t, s = bucket
        ids, positions = np.zeros(t, np.int32), np.zeros(t, np.int32)
        last_rows, room = np.zeros(s, np.int32), np.zeros(s, np.int32)
        at = 0
        for i, (tokens, start, _, want) in enumerate(rows):
            n = len(tokens)
            ids[at:at + n] = tokens
            positions[at:at + n] = np.arange(start, start + n)
            at += n
            last_rows[i], room[i] = at - 1, want
        meta = AttentionMetadata.build(
            query_lens=[len(r[0]) for r in rows], context_lens=[r[1] + len(r[0]) for r in rows],
            block_tables=[r[2] for r in rows], page_size=self.page_size, num_tokens=t, num_seqs=s,
            max_pages_per_seq=self.max_pages_per_seq)
        return DraftInputs(ids, positions, meta, last_rows, room)

    def catch_up(self, rows: list[Row]) -> None:
        """The draft's cache reads `rows`' tokens (their drafts wanted are ignored)."""
        bucket = self._bucket(self.catch_up_buckets, rows)
        run = self.catch_up_executables.get(bucket)
        self._caches = run(self.params, self.caches, *self.extra(), self.inputs(rows, bucket))

    def draft(self, rows: list[Row]) -> np.ndarray:
        """The drafts [len(rows), k] of `rows` (at most `tail` tokens each), the draft's cache holding what precedes
        them."""
        bucket = self._bucket(self.draft_buckets, rows)
        run = self.draft_executables.get(bucket)
        self._caches, drafts = run(self.params, self.caches, *self.extra(), self.inputs(rows, bucket))
        return np.asarray(drafts)[:len(rows)]

    def warmup(self) -> None:
        """Builds every bucket of both kinds, then runs each once (XLA:CPU finishes kernels on a first run): with
        nothing in it, the draft steps' padding drafting k tokens into page 0 (no sequence holds a page yet, and a
        sequence's draft KV is written before it is read)."""
        jobs = [(self.catch_up_executables, b) for b in self.catch_up_buckets] + \
            [(self.draft_executables, b) for b in self.draft_buckets]
        with concurrent.futures.ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 1, 4),
                                                   thread_name_prefix="jaxllm-draft-build") as pool:
            list(pool.map(lambda job: job[0].build(job[1]), jobs))
        for bucket in self.catch_up_buckets:
            self._caches = self.catch_up_executables.get(bucket)(self.params, self.caches, *self.extra(),
                                                                 self.inputs([], bucket))
        for bucket in self.draft_buckets:
            inputs = dataclasses.replace(self.inputs([], bucket), room=np.full(bucket[1], self.k, np.int32))
            self._caches, _ = self.draft_executables.get(bucket)(self.params, self.caches, *self.extra(), inputs)
        jax.block_until_ready(self._caches)
