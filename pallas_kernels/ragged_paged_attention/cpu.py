"""Paged attention on CPU: one XLA FFI custom call into the numba code of ``cpu_kernel`` writes the step's K/V
into the cache (in place: the cache outputs alias the donated inputs) and runs ragged paged attention.

For float32, float16 and bfloat16 caches (`jaxllm.kernels` picks the jnp reference for others); queries and
outputs are float32. Numerics match the reference's (float32 accumulation, the same online softmax) to float32
rounding; its speed against the reference and against llama.cpp is in docs/performance.md.

The plumbing (the FFI handler as a numba ``cfunc``, work items shared with XLA's thread pool) is in
`pallas_kernels.cpu_ffi`. Buffers are passed in place: the KV cache is never copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The kernel's "minus infinity" (finite: max() against it stays well defined), also a sink of "none"; defined here,
# where numba is not imported, and read by `cpu_kernel`
NEG = -3.0e38

TARGET = "jaxllm_cpu_ragged_paged_attention"
MAX_BLOCK_Q = 16
CACHE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def _load_handler():
    from pallas_kernels.ragged_paged_attention.cpu_kernel import handler
    return handler


def register() -> None:
    """Loads the kernel (compiled by numba, or from its disk cache) and registers the FFI target, once per process."""
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)


def block_q_of(query_start_loc: jax.Array) -> jax.Array:
    """Query tokens that share a K/V page read (one for decode, up to MAX_BLOCK_Q for prefill chunks): the largest
    power of two <= the mean query length of the step's sequences, counted at run time, as a bucket's padding
    sequences (no tokens) would make a lone sequence's 8 verification tokens look like 8 decodes, each reading every
    page alone. The outputs are the same bits for any value (`tests/pallas_kernels/ragged_paged_attention`)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).astype(jnp.int32)
    mean = jnp.maximum(1, jnp.sum(q_lens) // jnp.maximum(1, jnp.sum(q_lens > 0)))
    return jnp.minimum(MAX_BLOCK_Q, jnp.left_shift(1, 31 - jax.lax.clz(mean)))


def write_and_attend(
    q: jax.Array,  # [T, num_heads, head_dim]
    k: jax.Array,  # [T, kv_heads, head_dim]: this step's keys, written into the cache first
    v: jax.Array,  # [T, kv_heads, head_dim]
    k_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    v_cache: jax.Array,  # [kv_heads, num_pages, page_size, head_dim]
    slot_mapping: jax.Array,  # [T] int32 flat slot per token; negative = padding
    kv_lens: jax.Array,  # [S] int32
    block_tables: jax.Array,  # [S, max_pages_per_seq] int32
    query_start_loc: jax.Array,  # [S + 1] int32
    *,
    sm_scale: float,
    sliding_window: int | jax.Array | None = None,  # an int, or a traced int32 scalar (per layer)
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [num_heads]: each q head's sink logit
) -> tuple[jax.Array, jax.Array, jax.Array]:  # out [T, num_heads, head_dim], k_cache, v_cache
    """One custom call writes the step's K/V into the caches in place (outputs aliased to the donated cache
    inputs: no copy, and no per-layer scatter ops) and attends."""
    if k_cache.dtype not in CACHE_DTYPES:  # `jaxllm.kernels.choose_kernels` never picks this kernel for others
        raise ValueError(f"the CPU attention kernel reads float32, float16 or bfloat16 caches, not {k_cache.dtype}")
    register()
    t, h, d = q.shape
    window = 0 if sliding_window is None else sliding_window  # the kernel reads <= 0 as none
    params = jnp.stack([jnp.asarray(x, jnp.float32) for x in (sm_scale, window, soft_cap or 0.0)] +
                       [block_q_of(query_start_loc).astype(jnp.float32)])
    f32, i32, kv = jnp.float32, jnp.int32, k_cache.dtype
    # no sinks: the kernel's "none" value, which leaves every output as it was bit for bit
    sinks = jnp.full((h,), NEG, f32) if sinks is None else sinks.astype(f32)
    call = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((t, h, d), f32), jax.ShapeDtypeStruct(k_cache.shape, kv),
                                     jax.ShapeDtypeStruct(v_cache.shape, kv)), input_output_aliases={5: 1, 6: 2})
    # the new K/V rounded to the cache's type by XLA (as the reference's scatter does), copied in by the kernel
    out, k_cache, v_cache = call(params, q.astype(f32), k.astype(kv), v.astype(kv), slot_mapping.astype(i32),
                                 k_cache, v_cache, kv_lens.astype(i32), block_tables.astype(i32),
                                 query_start_loc.astype(i32), sinks)
    return out.astype(q.dtype), k_cache, v_cache
