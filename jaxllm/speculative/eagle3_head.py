"""An EAGLE-3 draft head, as vLLM and sglang load it (`LlamaForCausalLMEagle3`; "Eagle3LlamaForCausalLM" in
some conversions): one Llama decoder layer that reads, for each token, the token's embedding beside a hidden
state, and a small LM head over a draft vocabulary.

The hidden state of a row is either the target's (its residual stream entering three of its layers, side by side:
`aux_layers`, by default 2, L/2 and L-3 of L, projected to one width by ``fc``) or, while drafting, the head's own
from the row before (its output before the final norm). Row p of a sequence pairs the target's hidden state at
position p with the token at p + 1 and predicts the token at p + 2; it sits at position p (RoPE and KV slot).

The layer: ``x = [input_layernorm(embed), hidden_norm(hidden)]`` (2E wide) -> attention (q, k, v from 2E, o back to
E) + hidden -> gated MLP on post_attention_layernorm, plus that sum. ``norm`` of the result feeds ``lm_head``
[draft_vocab, E]; a draft token d is the target's token ``d + d2t[d]``. Without ``embed_tokens`` in the checkpoint
the head shares the target's embedding table."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.config import ConfigError, ModelConfig
from jaxllm.kernels import Kernels, attention_kernel, matmul_kernel
from jaxllm.models.attention import Attention
from jaxllm.models.layers import Embed, Linear, RMSNorm, _init
from jaxllm.models.llama import MLP, norm
from jaxllm.models.rope import rope_cos_sin, rope_frequencies

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    layer: ModelConfig  # the decoder layer's shape (num_layers 1; vocab_size: the target's, the embedding's rows)
    draft_vocab_size: int  # the LM head's rows
    target_hidden_size: int
    aux_layers: tuple[int, ...]  # the target layers whose inputs the head reads, ascending

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ConfigError(f"draft_vocab_size must be in [1, vocab_size {self.layer.vocab_size}], got "
                              f"{self.draft_vocab_size}")
        if not self.aux_layers or list(self.aux_layers) != sorted(set(self.aux_layers)):
            raise ConfigError(f"aux_layers must be distinct and ascending, got {self.aux_layers}")

    @property
    def feature_size(self) -> int:
        """The width of the target's features a row reads (``fc``'s input)."""
        return len(self.aux_layers) * self.target_hidden_size

    @classmethod
    def from_hf(cls, raw: dict[str, Any], target: ModelConfig) -> Eagle3Config:
        """A head's config.json, for `target` (its layer count sets the default aux layers)."""
        archs = raw.get("architectures") or []
        if not archs or archs[0] not in ARCHITECTURES:
            raise ConfigError(f"not an EAGLE-3 head: architectures {archs} (expected one of "
                              f"{', '.join(ARCHITECTURES)})")
        layer = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        n = target.num_layers
        eagle = raw.get("eagle_config") or {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)  # vLLM's default
        if not all(isinstance(i, int) and 0 <= i < n for i in ids):
            raise ConfigError(f"eagle_aux_hidden_state_layer_ids {list(ids)} are not layers of the target "
                              f"({n} layers)")
        return cls(layer, int(raw.get("draft_vocab_size") or layer.vocab_size),
                   int(raw.get("target_hidden_size") or target.hidden_size), tuple(sorted(set(ids))))


class Eagle3Attention(Attention):
    """Attention whose q, k and v read the 2E-wide [embedding, hidden] pair and whose output is E wide."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        super().__init__(dataclasses.replace(cfg, hidden_size=2 * cfg.hidden_size), dtype=dtype, rngs=rngs)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ("q_heads", "embed"), bias=cfg.o_bias,
                             dtype=dtype, rngs=rngs)


class Eagle3Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs | None):
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.hidden_norm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.self_attn = Eagle3Attention(cfg, dtype=dtype, rngs=rngs)
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)


class Eagle3Head(nnx.Module):
    causal = True
    multimodal = False

    def __init__(self, cfg: Eagle3Config, *, dtype, kernels: Kernels, rngs: nnx.Rngs | None,
                 embed_tokens: Embed | None = None):
        """rngs: random initialisation (None: shapes only, for the loader); embed_tokens: the target's table,
        shared, for a head that ships none."""
        layer = cfg.layer
        e = layer.hidden_size
        self.eagle = cfg
        self.config = layer  # what the engine sizes the head's KV cache by (one layer)
        self.dtype = dtype
        self.embed_tokens = embed_tokens if embed_tokens is not None else \
            Embed(layer.vocab_size, e, dtype=dtype, rngs=rngs)
        self.fc = Linear(cfg.feature_size, e, (None, "embed"), dtype=dtype, rngs=rngs)
        self.midlayer = Eagle3Layer(layer, dtype=dtype, rngs=rngs)
        self.norm = norm(layer, e, dtype, rngs)
        self.lm_head = Linear(e, cfg.draft_vocab_size, ("embed", None), dtype=dtype, rngs=rngs)
        # draft token d is target token d + d2t[d] (zeros: the same vocabulary)
        self.d2t = nnx.Param(_init(rngs, (cfg.draft_vocab_size,), jnp.int32, None), axes=(None,))
        self.set_kernels(kernels)

    def set_kernels(self, kernels: Kernels) -> None:
        """Sets the head's own modules' kernels (a shared embedding keeps the target's)."""
        attention_kernel(kernels)
        matmul_kernel(kernels)
        self.kernels = kernels
        for module in (self.fc, self.midlayer, self.norm, self.lm_head):
            for _, m in nnx.iter_modules(module):
                if isinstance(m, (Linear, RMSNorm)):
                    m.kernels = kernels

    def forward_paged(self, input_ids: jax.Array, positions: jax.Array, kv_cache, metadata: AttentionMetadata,
                      hidden: jax.Array, project: bool) -> tuple[jax.Array, jax.Array, Any]:
        """input_ids, positions [T]; hidden [T, F]: the target's features (`project`: through ``fc``) or the head's
        own [T, E] -> (normed [T, E] for `logits`, the next row's hidden [T, E], the updated one-layer cache)."""
        layer, cfg = self.midlayer, self.config
        if project:
            hidden = self.fc(hidden.astype(self.dtype))
        embeds = self.embed_tokens(input_ids).astype(self.dtype)
        inv_freq, attention_factor = rope_frequencies(cfg.rope, cfg.head_dim)
        cos, sin = rope_cos_sin(positions, inv_freq, attention_factor, cfg.rope.mrope_section,
                                cfg.rope.mrope_interleaved)
        x = jnp.concatenate([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], axis=-1)
        h, kv_cache = layer.self_attn.paged(x, cos, sin, kv_cache, metadata, attention_kernel(self.kernels), None)
        h = h + hidden
        out = layer.mlp(layer.post_attention_layernorm(h)) + h
        return self.norm(out), out, kv_cache

    def logits(self, normed: jax.Array) -> jax.Array:
        """normed [..., E] -> float32 logits over the draft vocabulary [..., draft_vocab]."""
        return self.lm_head(normed).astype(jnp.float32)

    def to_target(self, draft_ids: jax.Array) -> jax.Array:
        """Draft-vocabulary ids -> the target's."""
        return draft_ids + self.d2t[...][draft_ids]
