"""Self-attention of the Llama family, with two entry points:

- `dense`: plain causal attention over a ``[batch, seq]`` input, no cache (research / parity use);
- `paged`: a flat batch of ``T`` tokens whose K/V are written into the paged cache and whose attention
  runs through the ragged paged attention kernel the model's `jaxllm.kernels.Kernels` chose.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.models.layers import Linear, RMSNorm, _init
from jaxllm.models.rope import apply_rope


def dense_causal_attention(q, k, v, *, valid, positions, sm_scale, sliding_window=None, soft_cap=None, sinks=None):
    """q [B, S, H, D]; k, v [B, S, KVH, D]; valid [B, S] (False = padding); positions [B, S]; sinks [H]: each head's
    sink logit, one more column of every softmax whose value is zero (GPT-OSS)."""
    b, s, h, d = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, s, kvh, h // kvh, d) * sm_scale
    scores = jnp.einsum("bqkgd,bckd->bkgqc", qg, k.astype(jnp.float32))  # [B, KVH, G, S, S]
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    mask = (positions[:, None, :] <= positions[:, :, None]) & valid[:, None, :]
    if sliding_window is not None:
        mask &= positions[:, None, :] > positions[:, :, None] - sliding_window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1), (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    probs = jnp.where(mask[:, None, None], probs, 0.0)  # rows of padding tokens are all -inf: NaN otherwise
    out = jnp.einsum("bkgqc,bckd->bqkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, s, h, d).astype(q.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quant: dict | None = None):
        e, d = cfg.hidden_size, cfg.head_dim
        quant = quant or {}
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.sm_scale = cfg.attn_scale if cfg.attn_scale is not None else d ** -0.5
        self.soft_cap = cfg.attn_soft_cap
        # q, k and v in one matmul (fewer, larger matmuls run closer to memory bandwidth on CPU). Rows are
        # grouped by KV head, [kv_heads, group + 2, head_dim] (the group's q heads, then its k, then its v), so
        # splitting the rows by KV head for tensor parallelism splits q, k and v alike, whatever the tp size.
        self.qkv_proj = Linear(e, (cfg.num_heads + 2 * cfg.num_kv_heads) * d, ("embed", "kv_heads"),
                               bias=cfg.attention_bias, dtype=dtype, rngs=rngs, quant=quant.get("qkv_proj"))
        self.o_proj = Linear(cfg.num_heads * d, e, ("q_heads", "embed"), bias=cfg.o_bias, dtype=dtype, rngs=rngs,
                             quant=quant.get("o_proj"))
        # GPT-OSS: each q head's sink logit [heads], split with its heads
        self.sinks = nnx.Param(_init(rngs, (cfg.num_heads,), jnp.float32, 1.0), axes=("q_heads",)) \
            if cfg.attention_sinks else None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, offset=cfg.rms_norm_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, offset=cfg.rms_norm_offset)
        else:
            self.q_norm = self.k_norm = None

    def _sinks(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...].astype(jnp.float32)

    def _qkv(self, x, cos, sin, lora=None):
        lead = x.shape[:-1]
        qkv = self.qkv_proj(x, lora).reshape(*lead, self.num_kv_heads, self.group + 2, self.head_dim)
        q = qkv[..., :self.group, :].reshape(*lead, self.num_heads, self.head_dim)
        k, v = qkv[..., self.group, :], qkv[..., self.group + 1, :]  # [..., kv_heads, head_dim]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def dense(self, x, cos, sin, *, valid, positions, window):
        """x [B, S, E] -> [B, S, E]. window: the layer's attention window (None: the whole context; an int, or a
        traced int32 scalar when layers differ and run under a scan)."""
        q, k, v = self._qkv(x, cos, sin)
        out = dense_causal_attention(q, k, v, valid=valid, positions=positions, sm_scale=self.sm_scale,
                                     sliding_window=window, soft_cap=self.soft_cap, sinks=self._sinks())
        return self.o_proj(out.reshape(*x.shape[:-1], -1))

    def paged(self, x, cos, sin, kv: tuple[jax.Array, jax.Array], meta: AttentionMetadata, attn_fn: Callable,
              window, lora: jax.Array | None = None):
        """x [T, E]; kv: this layer's (k_cache, v_cache) -> ([T, E], updated kv). window: as in `dense`; lora [T]:
        each token's adapter slot (`jaxllm.models.lora`), None without adapters."""
        q, k, v = self._qkv(x, cos, sin, lora)
        out, k_cache, v_cache = attn_fn(q, k, v, kv[0], kv[1], meta.slot_mapping, meta.kv_lens, meta.block_tables,
                                        meta.query_start_loc, sm_scale=self.sm_scale, sliding_window=window,
                                        soft_cap=self.soft_cap, sinks=self._sinks())
        return self.o_proj(out.reshape(x.shape[0], -1), lora), (k_cache, v_cache)
