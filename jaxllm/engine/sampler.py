"""Token sampling on device, for one row per sequence that needs a token this step.

Order (as vLLM): logit bias (also used to forbid EOS/stop tokens before ``min_tokens``) -> repetition
penalty (prompt and output tokens) -> frequency and presence penalties (output tokens) -> greedy argmax, or
temperature -> top-k -> top-p -> min-p -> a Gumbel-max draw with the row's own key. The key folds in the
request's 64-bit seed, the choice index and the index of the token being sampled (each its own fold, so
keys never repeat whatever n is): a seeded request gets the same tokens whatever else is in the batch.
Logprobs are those of the raw model distribution (vLLM's default), after a structured-output mask (which comes
first: a token the grammar forbids has probability 0 everywhere).
Filtering needs a sort of the vocabulary and penalties a scatter over the sequence's tokens; both run only
in steps where some row asks for them. A step that needs nothing but greedy tokens (no row samples, asks for
logprobs, has a bias, penalties or a grammar) takes one branch that reads the logits once for the argmax: every
other step's work, the sort included, sits in the other branch, and no branch returns the logits (a conditional
that passes [S, V] logits through copies them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxllm.sampling_params import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    temperature: jax.Array  # [S] f32; 0 = greedy
    top_k: jax.Array  # [S] i32; 0 = off
    top_p: jax.Array  # [S] f32
    min_p: jax.Array  # [S] f32
    repetition_penalty: jax.Array  # [S] f32
    frequency_penalty: jax.Array  # [S] f32
    presence_penalty: jax.Array  # [S] f32
    seeds: jax.Array  # [S, 2] u32: the request's 64-bit seed (low, high word)
    choices: jax.Array  # [S] i32: the sequence's choice index within its request (0..n-1)
    steps: jax.Array  # [S] i32: index of the token being sampled
    bias_ids: jax.Array  # [S, B] i32 (-1 = none)
    bias_values: jax.Array  # [S, B] f32
    history: jax.Array  # [S, L] i32: the sequence's tokens (-1 = padding); [S, 1] when no penalties
    num_prompt: jax.Array  # [S] i32: how many leading history entries are prompt tokens
    any_filter: jax.Array  # [] bool
    any_penalty: jax.Array  # [] bool
    any_random: jax.Array  # [] bool: some row samples (is not greedy)
    any_logprobs: jax.Array  # [] bool: some row asked for logprobs
    token_mask: jax.Array  # [S, ceil(V / 32)] i32: bit j % 32 of word j // 32 allows token j (all ones: free)
    any_mask: jax.Array  # [] bool: some row is constrained
    any_bias: jax.Array  # [] bool: some row has a logit bias (its own, or EOS/stop tokens banned before min_tokens)
    # [S] i32: the row of `history` each row reads, in a speculative step's sample rows; None: its own
    history_rows: jax.Array | None = None

    @property
    def only_greedy(self) -> jax.Array:
        """[] bool: every row takes the argmax of the raw logits, and nothing else is asked for."""
        return ~(self.any_random | self.any_logprobs | self.any_penalty | self.any_mask | self.any_bias)


def _apply_mask(logits, t: SamplingTensors):
    s, v = logits.shape
    token = jnp.arange(v, dtype=jnp.int32)
    words = jnp.take(t.token_mask, token // 32, axis=1, mode="fill", fill_value=-1)  # [S, V]: each token's word
    bits = (words >> (token % 32)[None, :]) & 1
    return jnp.where(bits != 0, logits, -jnp.inf)


def _apply_penalties(logits, t: SamplingTensors):
    s, v = logits.shape
    hist = t.history if t.history_rows is None else t.history[t.history_rows]
    valid = hist >= 0
    idx = jnp.where(valid, hist, v)  # out of range: dropped
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= t.num_prompt[:, None])
    rows = jnp.arange(s)[:, None]
    counts = jnp.zeros((s, v), jnp.float32).at[rows, idx].add(is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((s, v), bool).at[rows, idx].set(True, mode="drop")
    rep = t.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - t.frequency_penalty[:, None] * counts - t.presence_penalty[:, None] * (counts > 0)


def _apply_filters(scaled, t: SamplingTensors):
    """scaled: logits / temperature. Keeps the top-k tokens, then the smallest prefix of those whose
    renormalised mass reaches top_p, then tokens with probability >= min_p * the top probability."""
    v = scaled.shape[-1]
    sorted_desc = -jnp.sort(-scaled, axis=-1)  # [S, V]
    pos = jnp.arange(v)[None, :]
    in_k = pos < jnp.where(t.top_k > 0, t.top_k, v)[:, None]
    probs = jax.nn.softmax(jnp.where(in_k, sorted_desc, -jnp.inf), axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep = in_k & (cum_before < t.top_p[:, None])  # the token that crosses top_p is kept
    threshold = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    min_p = sorted_desc[:, :1] + jnp.log(jnp.maximum(t.min_p[:, None], 1e-30))
    threshold = jnp.maximum(threshold, jnp.where(t.min_p[:, None] > 0, min_p, -jnp.inf))
    return jnp.where(scaled >= threshold, scaled, -jnp.inf)


def argmax_last(x: jax.Array, block: int = 1024) -> jax.Array:
    """jnp.argmax over the last axis of [S, V] (first index of the maximum), as two reductions: XLA:CPU
    runs one arg-reduction over 49k columns ~7x slower than a max over [S, V/1024, 1024] blocks followed
    by an argmax within the winning block (2.6 vs 0.36 ms for 32 rows of SmolLM2's vocabulary)."""
    s, v = x.shape
    if v <= block:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    padded = -(-v // block) * block
    blocks = jnp.pad(x, ((0, 0), (0, padded - v)), constant_values=-jnp.inf).reshape(s, padded // block, block)
    best_block = jnp.argmax(blocks.max(axis=-1), axis=-1)  # [S]
    within = jnp.take_along_axis(blocks, best_block[:, None, None], axis=1)[:, 0]  # [S, block]
    return (best_block * block + jnp.argmax(within, axis=-1)).astype(jnp.int32)


def argmax_for(platform: str):
    """The last-axis argmax for a step built for `platform`: the blocked form on CPU (`argmax_last`); elsewhere
    XLA's own, which reads the logits once in whatever layout the LM head wrote them (XLA:GPU writes them
    column-major, and the blocked form's reshape would transpose [S, V] first)."""
    if platform == "cpu":
        return argmax_last
    return lambda x: jnp.argmax(x, axis=-1).astype(jnp.int32)


def _draw(scaled, t: SamplingTensors, argmax):
    v = scaled.shape[-1]
    def key(seed, choice, step):
        k = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(jax.random.fold_in(k, choice), step)

    keys = jax.vmap(key)(t.seeds, t.choices, t.steps)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (v,), jnp.float32))(keys)
    return argmax(scaled + gumbel)


def _logprobs(logits, tokens):
    raw = jax.nn.log_softmax(logits, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(raw, min(MAX_LOGPROBS, logits.shape[-1]))
    chosen = jnp.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    rank = 1 + jnp.sum(raw > chosen[:, None], axis=-1, dtype=jnp.int32)  # vLLM's: 1 + tokens more likely
    return chosen, rank, top_ids.astype(jnp.int32), top_logprobs


def _no_logprobs(logits, tokens):
    s, k = logits.shape[0], min(MAX_LOGPROBS, logits.shape[-1])
    return (jnp.zeros((s,), jnp.float32), jnp.zeros((s,), jnp.int32), jnp.zeros((s, k), jnp.int32),
            jnp.zeros((s, k), jnp.float32))


def sample(logits: jax.Array, t: SamplingTensors, platform: str = "cpu"):
    """logits [S, V] f32 -> (tokens [S], their logprobs [S], their ranks [S] i32 (1: the likeliest), top ids
    [S, 20], top logprobs [S, 20]).
    Logprobs are zeros unless some row asked for them; the random draw and the filters run only when some
    row samples, penalties only when some row has them (so a greedy batch pays for one argmax). platform: the
    one the step is built for (`argmax_for`)."""
    argmax = argmax_for(platform)
    return jax.lax.cond(t.only_greedy, functools.partial(_greedy, argmax=argmax),
                        functools.partial(_sample, argmax=argmax), logits, t)


def _greedy(logits: jax.Array, t: SamplingTensors, argmax):
    tokens = argmax(logits)
    return (tokens, *_no_logprobs(logits, tokens))


def _sample(logits: jax.Array, t: SamplingTensors, argmax):
    s, v = logits.shape
    # the grammar's mask first: greedy, sampling, penalties and logprobs all see the constrained distribution
    logits = jax.lax.cond(t.any_mask, _apply_mask, lambda x, _: x, logits, t)
    raw = logits
    rows = jnp.arange(s)[:, None]
    logits = logits.at[rows, jnp.where(t.bias_ids >= 0, t.bias_ids, v)].add(t.bias_values, mode="drop")
    logits = jax.lax.cond(t.any_penalty, _apply_penalties, lambda x, _: x, logits, t)
    greedy = t.temperature <= 0
    best = argmax(logits)

    def draw(logits):
        scaled = logits / jnp.where(greedy, 1.0, t.temperature)[:, None]
        scaled = jax.lax.cond(t.any_filter, _apply_filters, lambda x, _: x, scaled, t)
        return jnp.where(greedy, best, _draw(scaled, t, argmax))

    tokens = jax.lax.cond(t.any_random, draw, lambda _: best, logits)
    return (tokens, *jax.lax.cond(t.any_logprobs, _logprobs, _no_logprobs, raw, tokens))
