"""The paged KV cache and the scatter of new tokens into it.

Layout, for K and for V: ``[kv_heads, num_pages, page_size, head_dim]``; a model's cache keeps every layer's pages
in one such array (``num_layers * pages_per_layer`` pages: the model offsets each layer's page ids).
- TPU: the last two dims are the (sublane, lane) tile, so one page of one head is a dense, tiled block a
  kernel can DMA into VMEM whole; head_dim (64/128) fills the 128 lanes.
- GPU: a page of one head is ``page_size * head_dim`` contiguous elements, so a program reading it issues
  fully coalesced loads.
- Tensor parallelism shards kv_heads, the leading dim, so each device's shard is one contiguous slab.
- The jnp reference gathers ``cache[:, pages]`` per step: whole contiguous pages per head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def abstract_kv_cache(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
                      dtype, sharding=None) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    """The shapes, dtype and placement `allocate_kv_cache` gives the K and V caches, allocating nothing."""
    shape = (num_kv_heads, num_layers * num_pages, page_size, head_dim)  # [kv_heads, pages, page_size, head_dim]
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    one = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    return one, one


def allocate_kv_cache(num_layers: int, num_kv_heads: int, num_pages: int, page_size: int, head_dim: int,
                      dtype, sharding=None) -> tuple[jax.Array, jax.Array]:
    """Zeroed K and V caches of `num_pages` pages for each of `num_layers` layers, placed by `sharding` (default:
    the first device)."""
    spec, _ = abstract_kv_cache(num_layers, num_kv_heads, num_pages, page_size, head_dim, dtype, sharding)
    shape, sharding = spec.shape, spec.sharding
    if all(d.platform == "cpu" for d in sharding.device_set):
        # Host memory: copying numpy's lazily zeroed pages (never written) is far faster than XLA writing the
        # zeros, and start-up waits for it (figures: ../shared/NOTES.md, "Start-up facts").
        def make():
            return jax.device_put(np.zeros(shape, dtype), sharding)
    else:
        make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return make(), make()


@jax.named_scope("kv_write")
def write_kv(k_cache: jax.Array, v_cache: jax.Array, k: jax.Array, v: jax.Array,
             slot_mapping: jax.Array) -> tuple[jax.Array, jax.Array]:
    """k_cache/v_cache [kv_heads, num_pages, page_size, head_dim]; k/v [T, kv_heads, head_dim];
    slot_mapping [T] (negative = padding token, dropped)."""
    kvh, pages, page_size, d = k_cache.shape
    num_slots = pages * page_size
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)  # out of range -> dropped by the scatter

    def scatter(cache, new):
        flat = cache.reshape(kvh, num_slots, d)
        flat = flat.at[:, slots].set(new.swapaxes(0, 1).astype(cache.dtype), mode="drop")
        return flat.reshape(cache.shape)

    return scatter(k_cache, k), scatter(v_cache, v)
