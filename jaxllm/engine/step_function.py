"""The function every step executable is compiled from: the model's forward through the paged KV cache, the LM
head on the rows that need a token, sampling, prompt logprobs and pooling outputs. Pure: weights, caches and
`StepInputs` in, the updated caches and the step's outputs out."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.engine import prompt_logprobs
from jaxllm.engine.sampler import SamplingTensors, sample
from jaxllm.engine.step_inputs import StepInputs
from jaxllm.sampling_params import MAX_LOGPROBS


def step_function(graphdef, state_def, generates: bool, pools: bool, params, caches, inputs: StepInputs,
                  capture: tuple[int, ...] = ()):
    """generates: False for a model that only pools (its steps sample nothing); pools: False for a model that only
    generates (its steps compute no pooling outputs); capture: the layers whose inputs every token leaves in the
    feature cache (caches: (K, V, features [slots, len(capture) * E]); an EAGLE-3 head reads them). Returns
    (caches, packed sampler output [R, 3 + 2 * 20] i32 (R sample rows: S, or `SpecRows`' R with speculation),
    pooled [S, 3, E], classified [S, labels], next ids [T], prompt logprobs [T, width])."""
    model = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    ids, meta, logit_rows = inputs.ids, inputs.meta, inputs.logit_rows
    kv = caches[:2]
    # named scopes reach the compiled program's op metadata: a device profile sorts kernels by them
    with jax.named_scope("model"):
        if capture:  # a text model (speculation refuses vision-language ones)
            hidden, kv, features = model.forward_paged(ids, inputs.positions, kv, meta, lora=inputs.lora,
                                                       capture=capture)
            caches = (*kv, store_features(caches[2], meta.slot_mapping, features))
        elif inputs.lora is not None:  # a model with LoRA tables (text only)
            hidden, caches = model.forward_paged(ids, inputs.positions, kv, meta, lora=inputs.lora)
        elif inputs.images is None:
            hidden, caches = model.forward_paged(ids, inputs.positions, kv, meta)
        else:  # a vision-language model: positions [3, T], images [levels, T, E] (each image-pad token's embeddings)
            hidden, caches = model.forward_paged(ids, inputs.positions, kv, meta, image_embeds=inputs.images)
    s = logit_rows.shape[0]
    if generates:
        # the sample rows in use: a prefix of the S rows (each real sequence's, padding after them), of the R
        # speculative ones at most the step's real tokens
        live = jnp.sum(meta.kv_lens > 0, dtype=jnp.int32)
        plain = functools.partial(_sample_rows, model, hidden, logit_rows, inputs.sampling, live)
        if inputs.spec is None:
            tokens, packed = plain()
        else:  # a step without drafts pays for one LM-head row per sequence, not R
            spec = inputs.spec
            r = spec.rows.shape[0]

            def speculative():
                return _sample_rows(model, hidden, spec.rows, per_sample_row(inputs.sampling, spec.seq, spec.offset),
                                    meta.query_start_loc[-1])

            def padded():
                tokens, packed = plain()
                return jnp.pad(tokens, (0, r - s)), jnp.pad(packed, ((0, r - s), (0, 0)))
            tokens, packed = jax.lax.cond(spec.active, speculative, padded)
        # [T, prompt_logprobs.width] i32: each prompt row's logprob of the next prompt token (a step with none: zeros)
        with jax.named_scope("prompt_logprobs"):
            prompt = prompt_logprobs.compute(model.logits, hidden, inputs.prompt_targets, model.config.vocab_size)
    else:  # a model that only pools
        tokens = jnp.zeros((s,), jnp.int32)
        packed = jnp.zeros((s, 3 + 2 * MAX_LOGPROBS), jnp.int32)
        prompt = jnp.zeros((ids.shape[0], prompt_logprobs.width(model.config.vocab_size)), jnp.int32)
    # [T]: row i's token at position i, the ids of a decode step that follows this one with the same sequences
    # (a step dispatched before this one's tokens are read back: see LLMEngine.step; never after drafts)
    t = ids.shape[0]
    next_ids = jnp.zeros((t,), jnp.int32).at[:min(s, t)].set(tokens[:min(s, t)])
    if not pools:  # a model that only generates: the same outputs, none of the work (decode steps stay lean)
        return (caches, packed, jnp.zeros((s, 3, hidden.shape[-1]), jnp.float32), jnp.zeros((s, 0), jnp.float32),
                next_ids, prompt)
    pooled = pool_chunks(hidden, meta)
    return caches, packed, pooled, model.classify(pooled), next_ids, prompt


def store_features(cache: jax.Array, slots: jax.Array, features: jax.Array) -> jax.Array:
    """cache [slots, F] with features [T, F] written at each token's KV slot (padding tokens' -1: nowhere): a
    token's features live and die with its KV, in the same pages."""
    n = cache.shape[0]
    return cache.at[jnp.where(slots >= 0, slots, n)].set(features.astype(cache.dtype), mode="drop")


HEAD_TIERS = (1, 8, 32)  # rows the LM head and sampler may run on below a step's N, on CPU (`_sample_rows`)


def _sample_rows(model, hidden, rows, sampling: SamplingTensors, live: jax.Array):
    """The LM head on `rows` [N] of hidden [T, E] and their tokens -> (tokens [N], packed [N, 3 + 2 * 20] i32),
    computed for the first of HEAD_TIERS' row counts (or N) that holds the `live` rows in use (a prefix), the
    other rows zeros. A bucket's N is its sequence count, min(T, max_num_seqs): a lone prompt's prefill step of 320
    tokens has N = 64, 63 of them padding, and on CPU each row costs its full matmul, and its sampling over the
    vocabulary (padding one row's logits to 64 and sampling them all took ~4.3 ms of a 41 ms 120-token prefill on
    the Zen 5 EPYC: docs/performance.md). A row's logits and token do not depend on the row count (the kernels'
    rows are independent, the sampler works row by row: batch invariance). On GPU and TPU a step computes all N
    rows: there the head at these row counts should be bound by reading its weights, not by its rows (inferred,
    not measured on a device), and one branch keeps one executable's code, not four."""
    n = rows.shape[0]
    tiers = [t for t in HEAD_TIERS if t < n and model.kernels.platform == "cpu"] + [n]

    def tier(m: int):
        def run():
            with jax.named_scope("logits"):
                logits = model.logits(hidden[rows[:m]])  # [m, V]: only the rows that get a token
            with jax.named_scope("sampler"):
                out = sample(logits, _first_rows(sampling, m, n), model.kernels.platform)
            tokens, packed = _pack(*out)
            if m == n:
                return tokens, packed
            return jnp.pad(tokens, (0, n - m)), jnp.pad(packed, ((0, n - m), (0, 0)))
        return run
    if len(tiers) == 1:
        return tier(n)()
    index = jnp.sum(jnp.asarray(tiers[:-1], jnp.int32) < live, dtype=jnp.int32)  # the first tier >= live
    return jax.lax.switch(index, [tier(m) for m in tiers])


def _first_rows(t: SamplingTensors, m: int, n: int) -> SamplingTensors:
    """The sampling inputs of the first m of n sample rows (the penalty history stays whole where rows point into
    it)."""
    if m == n:
        return t
    history = t.history[:m] if t.history_rows is None else t.history
    rows = jax.tree.map(lambda a: a[:m] if a.ndim and a.shape[0] == n else a,
                        dataclasses.replace(t, history=None, history_rows=None))
    return dataclasses.replace(rows, history=history,
                               history_rows=None if t.history_rows is None else t.history_rows[:m])


def _pack(tokens, logprobs, ranks, top_ids, top_logprobs):
    """(tokens, packed [N, 3 + 2 * 20] i32): one transfer a step instead of five, `unpack`ed on the host."""
    bits = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.int32)
    return tokens, jnp.concatenate([tokens[:, None], bits(logprobs)[:, None], ranks[:, None], top_ids,
                                    bits(top_logprobs)], axis=1)


def per_sample_row(t: SamplingTensors, seq: jax.Array, offset: jax.Array) -> SamplingTensors:
    """The sampling inputs of R sample rows, each its sequence's (`seq` [R]: a row of `t`) with its token index +
    `offset` [R] (its own random key); the penalty history stays one row per sequence (`history_rows` points
    into it)."""
    s = t.temperature.shape[0]
    rows = jax.tree.map(lambda a: a[seq] if a.ndim and a.shape[0] == s else a,
                        dataclasses.replace(t, history=None, history_rows=None))
    return dataclasses.replace(rows, steps=rows.steps + offset, history=t.history, history_rows=seq)


def pool_chunks(hidden: jax.Array, meta: AttentionMetadata) -> jax.Array:
    """hidden [T, E], query_start_loc [S + 1] -> [S, 3, E] float32: each sequence's first, last and summed hidden
    state in this step (what pooling needs from a prefill chunk; the host combines chunks). Read back only in a
    step that has pooling requests (as is a classifying model's head on the first: `classified` [S, labels])."""
    qsl = meta.query_start_loc
    t, s = hidden.shape[0], qsl.shape[0] - 1
    h = hidden.astype(jnp.float32)
    total = jax.ops.segment_sum(h, meta.sequence_of_token(t), num_segments=s)  # padding tokens (id s) dropped
    first = h[jnp.clip(qsl[:-1], 0, t - 1)]
    last = h[jnp.clip(qsl[1:] - 1, 0, t - 1)]
    return jnp.stack([first, last, total], axis=1)


def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A step's packed output [R, ...] -> (tokens [R], logprobs [R], ranks [R], top ids [R, 20], top logprobs
    [R, 20])."""
    n = (packed.shape[1] - 3) // 2
    floats = packed.view(np.float32)
    return packed[:, 0], floats[:, 1], packed[:, 2], packed[:, 3:3 + n], floats[:, 3 + n:]
