"""How big the paged KV cache is: pages, page size, element type, and the longest sequence they allow."""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp

from jaxllm.config import ConfigError
from jaxllm.dtypes import resolve_kv_cache_dtype
from jaxllm.engine import multihost
from jaxllm.engine.config import EngineConfig
from jaxllm.kernels import CPU_CACHE_DTYPES
from jaxllm.models.protocol import Model

logger = logging.getLogger("jaxllm.engine")


@dataclasses.dataclass(frozen=True)
class KVPlan:
    num_pages: int
    page_size: int
    max_model_len: int
    dtype: object  # the cache's element type (a numpy/JAX dtype)

    def __post_init__(self):
        if self.num_pages < 1 or self.page_size < 1 or self.max_model_len < 1:
            raise ConfigError(f"a KV cache needs pages and a length: {self}")


def kv_budget_bytes(fraction: float) -> int:
    """The KV cache's memory: on CPU a fraction of *total* RAM, so the page count (a compiled shape) is the
    same from one start to the next and the persistent compilation cache hits (free RAM drifts by tens of MB
    between starts); only when that would not fit in the RAM free now, a fraction of the free RAM. On an
    accelerator, a fraction of the device memory left after the weights."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        page = os.sysconf("SC_PAGE_SIZE")
        total, free = os.sysconf("SC_PHYS_PAGES") * page, os.sysconf("SC_AVPHYS_PAGES") * page
        budget = int(total * fraction)
        if budget > 0.9 * free:
            logger.warning("kv_memory_fraction %.2f of RAM (%.1f GiB) exceeds the free RAM (%.1f GiB): using %.2f of "
                           "the free RAM; the page count will vary between starts", fraction, budget / 2**30,
                           free / 2**30, fraction)
            budget = int(free * fraction)
        return budget
    stats = device.memory_stats() or {}
    return int((stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)) * fraction)


def _page_bytes(config: EngineConfig, model: Model) -> int:
    """The bytes of one page of `model`'s K and V caches over all its layers."""
    cfg = model.config
    dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype)
    return 2 * cfg.num_layers * cfg.num_kv_heads * config.page_size * cfg.head_dim * jnp.dtype(dtype).itemsize


def plan_kv_cache(config: EngineConfig, model: Model, draft: Model | None = None, feature_size: int = 0) -> KVPlan:
    """A causal model's cache takes `kv_memory_fraction` of the memory (or `num_pages`); an encoder reads no
    cache: pages for one step's slot mapping, inputs of at most one step. Every host of a job agrees on the
    page count (a compiled shape). draft: a speculative draft model (or head), whose cache has as many pages (the
    same page ids): the memory holds both; feature_size: the values each slot keeps for an EAGLE-3 head (the
    feature cache, in the model's dtype)."""
    c, cfg = config, model.config
    dtype = resolve_kv_cache_dtype(c.kv_cache_dtype, model.dtype)
    models = [model] + ([draft] if draft is not None else [])
    for m in models:
        if m.kernels.attention == "cpu" and jnp.dtype(resolve_kv_cache_dtype(c.kv_cache_dtype, m.dtype)) \
                not in CPU_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype={c.kv_cache_dtype}: the model's cpu attention kernel reads "
                              "float32, float16 or bfloat16 caches; build the model with attn_impl='reference'")
    page_bytes = sum(_page_bytes(c, m) for m in models) + \
        feature_size * c.page_size * jnp.dtype(model.dtype).itemsize
    if model.causal:
        num_pages = c.num_pages or max(2, kv_budget_bytes(c.kv_memory_fraction) // page_bytes)
        max_len = c.max_model_len or cfg.max_position_embeddings
    else:
        budget = c.max_num_batched_tokens
        num_pages = -(-budget // c.page_size) + c.max_num_seqs
        max_len = min(c.max_model_len or cfg.max_input_tokens, cfg.max_input_tokens, budget)
    num_pages = multihost.agree_min(num_pages)
    max_len = min(max_len, num_pages * c.page_size)
    logger.info("KV cache: %d pages x %d tokens = %d tokens (%.2f GiB); max_model_len %d; "
                "maximum concurrency at max_model_len: %.1f", num_pages, c.page_size, num_pages * c.page_size,
                num_pages * page_bytes / 2**30, max_len, num_pages * c.page_size / max_len)
    return KVPlan(num_pages, c.page_size, max_len, dtype)
