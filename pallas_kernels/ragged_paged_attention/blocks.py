"""Query blocking shared by the Pallas kernels.

The kernels cut the flat token batch into blocks of ``block_q`` tokens. A block may hold the tail of one
sequence, several whole decode sequences and the head of another; each kernel program walks only the
sequences that intersect its block (``first_seq..last_seq``) and, for each, only the pages that hold
positions its tokens may attend to. Everything here is cheap integer work done once per step, outside the
kernel (XLA merges the layers' identical copies of it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Tokens per query block; times the q heads per KV head it gives >= 16 matmul rows.
DEFAULT_BLOCK_Q = 16


def block_seq_ranges(query_start_loc: jax.Array, num_tokens: int, block_q: int) -> tuple[jax.Array, jax.Array]:
    """For each query block: the first and last (inclusive) sequence owning a token in it, as int32
    [num_blocks] arrays. A block with no real token gets an empty range (first > last)."""
    num_blocks = -(-num_tokens // block_q)
    total = query_start_loc[-1]
    start = jnp.arange(num_blocks, dtype=jnp.int32) * block_q
    end = jnp.minimum(start + block_q, total) - 1  # last real token of the block
    ends = query_start_loc[1:]
    # compare_all: one [num_blocks, S] comparison, no loop. The default binary search is a while loop, which
    # XLA:GPU ran as host-side iterations that each waited for the device (the step's dispatch then blocked).
    first = jnp.searchsorted(ends, start, side="right", method="compare_all").astype(jnp.int32)
    last = jnp.searchsorted(ends, end, side="right", method="compare_all").astype(jnp.int32)
    empty = start >= total
    return jnp.where(empty, 1, first), jnp.where(empty, 0, last)
