"""The shared decoder of the Llama family (Llama 2/3, Mistral, SmolLM, Qwen2, Qwen3).

The model is a pure function of its parameters and explicit inputs. Two ways to call it:

- ``model(input_ids [B, S], positions=None, attention_mask=None) -> logits [B, S, V]``: no cache, plain
  causal attention; what a notebook uses after editing a module.
- ``model.forward_paged(input_ids [T], positions [T], kv_cache, metadata) -> (hidden [T, E], kv_cache)``
  followed by ``model.logits(hidden[rows])``: the engine path through the paged KV cache.

The layers are an `nnx.List` (what a constructor builds and a notebook edits; the forward unrolls them) or,
after `stack_layers()`, one `StackedLayers` module run with a scan (what the loaders return).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.kernels import (
    Kernels,
    attention_kernel,
    choose_kernels,
    grouped_quantized_matmul_kernel,
    matmul_kernel,
    quantized_matmul_kernel,
)
from jaxllm.models.attention import Attention
from jaxllm.models.family import EXPERT_QUANTIZABLE, LLAMA_QUANTIZABLE
from jaxllm.models.layers import Embed, Linear, RMSNorm
from jaxllm.models.moe import ExpertLinear
from jaxllm.models.rope import rope_cos_sin, rope_frequencies
from jaxllm.models.stacked_layers import StackedLayers
from pallas_kernels.quantized_matmul import QuantFormat

QUANTIZABLE = LLAMA_QUANTIZABLE + EXPERT_QUANTIZABLE  # which weights a quantization plan names
QuantPlan = dict[str, QuantFormat]  # weight name (QUANTIZABLE) -> its format; absent: float

# K and V, each [kv_heads, num_layers * pages_per_layer, page_size, head_dim]: every layer's pages in one array
# (layer l's page p is page l * pages_per_layer + p), so a scan over layers carries two arrays, not 2 x layers.
KVCache = tuple[jax.Array, jax.Array]
WHOLE_CONTEXT = 1 << 30  # a runtime window that masks nothing


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quant: QuantPlan | None = None):
        e, f = cfg.hidden_size, cfg.intermediate_size
        quant = quant or {}
        # gate and up in one matmul, rows interleaved [mlp, 2] (gate_i, up_i): a tensor-parallel split of the
        # rows keeps each gate row with its up row, whatever the tp size.
        self.gate_up_proj = Linear(e, 2 * f, ("embed", "mlp"), dtype=dtype, rngs=rngs, quant=quant.get("gate_up_proj"))
        self.down_proj = Linear(f, e, ("mlp", "embed"), dtype=dtype, rngs=rngs, quant=quant.get("down_proj"))

        self.activation = cfg.activation

    def __call__(self, x, lora: jax.Array | None = None):
        """lora [T]: each token's adapter slot (x [T, E]; `jaxllm.models.lora`)."""
        gate_up = self.gate_up_proj(x, lora).reshape(*x.shape[:-1], -1, 2)  # [..., mlp, 2]
        return self.down_proj(activate(gate_up[..., 0], self.activation) * gate_up[..., 1], lora)


def activate(x: jax.Array, activation: str) -> jax.Array:
    if activation == "silu":
        return jax.nn.silu(x)
    return jax.nn.gelu(x, approximate=activation == "gelu_tanh")


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, quant: QuantPlan | None = None,
                 attention: type[nnx.Module] = Attention, mlp: type[nnx.Module] = MLP):
        """attention, mlp: the family's factories (`FamilySpec.attention`, `.mlp`), each built as
        ``factory(cfg, dtype=, rngs=, quant=)``; the attention module's ``paged``/``dense`` and the MLP's call are
        what the layer runs."""
        self.input_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.self_attn = attention(cfg, dtype=dtype, rngs=rngs, quant=quant)
        # Llama's norm before the MLP; with sandwich norms (Gemma), the one on the attention's output, as
        # Gemma's checkpoints name it
        self.post_attention_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.mlp = mlp(cfg, dtype=dtype, rngs=rngs, quant=quant)
        sandwich = cfg.sandwich_norms
        self.pre_feedforward_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs) if sandwich else None
        self.post_feedforward_layernorm = norm(cfg, cfg.hidden_size, dtype, rngs) if sandwich else None

    def __call__(self, x, attend, lora: jax.Array | None = None):
        """lora [T]: each token's adapter slot, for the MLP (`attend` passes it to the attention)."""
        mlp = self.mlp if lora is None else (lambda h: self.mlp(h, lora))
        h, extra = attend(self.self_attn, self.input_layernorm(x))
        if self.pre_feedforward_layernorm is None:
            x = x + h
            return x + mlp(self.post_attention_layernorm(x)), extra
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(mlp(self.pre_feedforward_layernorm(x))), extra


def norm(cfg: ModelConfig, dim: int, dtype, rngs: nnx.Rngs | None) -> RMSNorm:
    """An RMSNorm of the config's kind (Llama's or Gemma's)."""
    return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype, rngs=rngs, offset=cfg.rms_norm_offset)


class LlamaForCausalLM(nnx.Module):
    causal = True  # `jaxllm.models.protocol.Model`
    multimodal = False

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, attn_impl: str = "auto", matmul_impl: str = "auto",
                 kernels: Kernels | None = None, rngs: nnx.Rngs | None = None, quantization: QuantPlan | None = None):
        """rngs: random initialisation; None builds shapes only, for a loader to fill in. kernels: the kernel
        choice (`jaxllm.kernels.choose_kernels`, e.g. for another platform); default: attn_impl and matmul_impl
        chosen for this process's backend. quantization: the weights kept quantized and their formats."""
        unknown = set(quantization or {}) - set(QUANTIZABLE)
        if unknown:
            raise ValueError(f"cannot quantize {sorted(unknown)}; quantizable weights: {QUANTIZABLE}")
        quant = dict(quantization or {})
        self.config = cfg
        self.dtype = dtype
        self.quantization = tuple(sorted(quant.items()))  # static (hashable): part of the graph definition
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs,
                                  quant=quant.get("embed_tokens"))
        parts = _family_parts(cfg)
        self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs, quant=quant, **parts)
                                for _ in range(cfg.num_layers)])
        self.norm = norm(cfg, cfg.hidden_size, dtype, rngs)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), dtype=dtype, rngs=rngs, quant=quant.get("lm_head"))
        self.set_kernels(kernels or choose_kernels(attn_impl, matmul_impl, dtype=dtype))
        self.classifier_token_ids: tuple[int, ...] = ()  # static: a reranker's label tokens (see `classify`)

    def set_context_length(self, max_len: int) -> None:
        """The longest context this model will run (the engine's max_model_len), for a RoPE whose frequencies
        depend on it: LongRoPE runs its long factors when `max_len` exceeds the original context, its short ones
        otherwise, for every position (llama.cpp's choice by its context size). Call before tracing a step."""
        rope = self.config.rope
        if rope.rope_type == "longrope":
            long = max_len > rope.original_max_position_embeddings
            self.config = dataclasses.replace(self.config, rope=dataclasses.replace(rope, long_context=long))

    def set_classifier_tokens(self, token_ids: tuple[int, ...]) -> None:
        """Makes the model a classifier whose label scores are the last token's logits of `token_ids` (a
        Qwen3-Reranker reads ("no", "yes")): what `classify` returns."""
        self.classifier_token_ids = tuple(int(t) for t in token_ids)

    @property
    def classifies(self) -> bool:
        return bool(self.classifier_token_ids)

    def set_kernels(self, kernels: Kernels) -> None:
        """Uses `kernels` for attention and for every linear layer (and the tied LM head). Loads them now: a CPU
        kernel's FFI target must be registered before a step loaded from the executable cache runs (such a step
        is never traced)."""
        attention_kernel(kernels)
        matmul_kernel(kernels)
        if self.quantization:
            quantized_matmul_kernel(kernels)
        if any(role in EXPERT_QUANTIZABLE for role, _ in self.quantization):
            grouped_quantized_matmul_kernel(kernels)
        self.kernels = kernels
        for _, module in nnx.iter_modules(self):
            if isinstance(module, (Linear, Embed, RMSNorm, ExpertLinear)):
                module.kernels = kernels

    def set_matmul_impl(self, impl: str) -> None:
        """Switches the matmul kernel only (e.g. "reference" or "cpu"), keeping the rest of the choice."""
        k = self.kernels
        self.set_kernels(dataclasses.replace(k, matmul=choose_kernels(
            k.attention, impl, platform=k.platform, dtype=self.dtype, interpret=k.interpret).matmul))

    @property
    def attn_impl(self) -> str:
        return self.kernels.attention

    @property
    def matmul_impl(self) -> str:
        return self.kernels.matmul

    @property
    def quant_plan(self) -> QuantPlan:
        return dict(self.quantization)

    @property
    def stacked(self) -> bool:
        return isinstance(self.layers, StackedLayers)

    def stack_layers(self) -> bool:
        """Stores the layers as one scanned `StackedLayers` module if they share one structure (their per-layer
        arrays are deleted as they are copied: hold no references to them). Returns whether they are stacked."""
        if not self.stacked:
            stacked = StackedLayers.from_layers(list(self.layers))
            if stacked is not None:
                self.layers = stacked
        return self.stacked

    def unstack_layers(self) -> None:
        """Back to an `nnx.List` of separate layers, e.g. to edit one of them."""
        if self.stacked:
            self.layers = nnx.List(self.layers.unstack())

    def arrange_layers(self) -> None:
        """The layers as the kernel choice's layer loop runs them: stacked for a scan, separate for an unrolled
        loop (GPU). Separate, every layer's GEMMs are one fused computation over their own parameters, which
        XLA:GPU compiles and autotunes once; static slices of a stack differ by their offsets, a fusion per layer
        (Llama-3.1-8B's decode step: 133 distinct GEMM fusions instead of 9, and builds of 1-3 minutes a bucket on
        an H100). Unstacking deletes each stacked array once its layers exist (one parameter's worth of extra
        memory)."""
        if self.kernels.layer_loop == "unrolled":
            if self.stacked:
                self.layers = nnx.List(self.layers.unstack(release=True))
        else:
            self.stack_layers()

    def _run_layers(self, fn, x: jax.Array, carry):
        """fn(layer, x, carry, index) -> (x, carry) over the layers: stacked, as the kernel choice says (a scan, or
        unrolled over static slices on GPU); unrolled otherwise."""
        if self.stacked:
            return self.layers.scan(fn, x, carry, unroll=self.kernels.layer_loop == "unrolled")
        for index, layer in enumerate(self.layers):
            x, carry = fn(layer, x, carry, index)
        return x, carry

    def _rope(self, positions: jax.Array):
        """cos, sin [..., rotary_dim] of every layer; with a `local_rope`, a pair per kind of layer (global,
        windowed), which `layer_rope` picks from."""
        cfg = self.config

        def cos_sin(rope):  # frequencies are trace-time numpy constants, not parameters
            inv_freq, attention_factor = rope_frequencies(rope, cfg.head_dim)
            return rope_cos_sin(positions, inv_freq, attention_factor, rope.mrope_section, rope.mrope_interleaved)

        if cfg.local_rope is None:
            return cos_sin(cfg.rope)
        return cos_sin(cfg.rope), cos_sin(cfg.local_rope)

    def layer_rope(self, rope, index):
        """Layer `index`'s (cos, sin) from `_rope`'s: by the layer's kind when windowed layers rotate by their own
        RoPE (a static choice when the layers run unrolled, a select by the scan's counter otherwise)."""
        if self.config.local_rope is None:
            return rope
        (cos_g, sin_g), (cos_l, sin_l) = rope
        local = [w > 0 for w in self.config.layer_windows]
        if isinstance(index, int):
            return (cos_l, sin_l) if local[index] else (cos_g, sin_g)
        is_local = jnp.asarray(local)[index]
        return jnp.where(is_local, cos_l, cos_g), jnp.where(is_local, sin_l, sin_g)

    def window(self, index) -> int | jax.Array | None:
        """Layer `index`'s attention window: the config's static one when every layer has the same; with
        `layer_windows`, the layer's (a static int when the layers run unrolled, a lookup by the scan's counter
        otherwise; a whole-context layer's is then `WHOLE_CONTEXT`)."""
        windows = self.config.layer_windows
        if windows is None:
            return self.config.sliding_window
        if isinstance(index, int):
            return windows[index] or None
        return jnp.asarray([w or WHOLE_CONTEXT for w in windows], jnp.int32)[index]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> float32 logits [..., V]."""
        out = (self.embed_tokens.attend(hidden) if self.lm_head is None else self.lm_head(hidden)).astype(jnp.float32)
        cap = self.config.final_soft_cap
        return out if cap is None else cap * jnp.tanh(out / cap)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """Token embeddings [..., E], scaled by sqrt(hidden_size) where the config says (Gemma: the factor rounded
        to the model's dtype first, as its checkpoints were trained)."""
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return x

    def classify(self, pooled: jax.Array) -> jax.Array:
        """pooled [S, 3, E] (each sequence's first, last, summed final hidden state) -> [S, labels] float32: the
        last token's logits of the classifier tokens (none set: [S, 0]). Only those rows of the LM head are read,
        unless it is quantized."""
        ids = self.classifier_token_ids
        last = pooled[:, 1]
        if not ids:
            return jnp.zeros((last.shape[0], 0), jnp.float32)
        index = jnp.asarray(ids, jnp.int32)
        if self.lm_head is None:
            rows = self.embed_tokens(index)  # [K, E] (a quantized table dequantizes just these rows)
        elif self.lm_head.quant is None:
            rows = self.lm_head.weight[...][index]
        else:
            return self.logits(last)[:, index]
        return jnp.matmul(last.astype(jnp.float32), rows.astype(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None,
                 attention_mask: jax.Array | None = None, inputs_embeds: jax.Array | None = None,
                 deepstack: jax.Array | None = None) -> jax.Array:
        """input_ids [B, S]; positions [B, S] (default 0..S-1; with M-RoPE [3, B, S], the causal order is then the
        tokens'); attention_mask [B, S] (1 = real token); inputs_embeds [B, S, E]: used instead of the token
        embeddings (a vision-language model's, with its images' in place); deepstack [D, B, S, E]: added to the
        outputs of the first D layers (Qwen3-VL's visual features, zero outside image tokens)."""
        b, s = input_ids.shape
        order = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        if positions is None:
            positions = order if self.config.rope.mrope_section is None else jnp.broadcast_to(order, (3, b, s))
        causal = positions if positions.ndim == 2 else order
        valid = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
        rope = self._rope(positions)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds

        def run(layer, x, carry, index):
            window = self.window(index)
            cos, sin = self.layer_rope(rope, index)
            x, carry = layer(x, lambda attn, h: (attn.dense(h, cos, sin, valid=valid, positions=causal,
                                                            window=window), None))
            return _add_deepstack(x, deepstack, index), carry

        x, _ = self._run_layers(run, x, None)
        return self.logits(self.norm(x))

    def forward_paged(self, input_ids: jax.Array, positions: jax.Array, kv_cache: KVCache,
                      metadata: AttentionMetadata, inputs_embeds: jax.Array | None = None,
                      deepstack: jax.Array | None = None, lora: jax.Array | None = None,
                      capture: tuple[int, ...] = ()) -> tuple:
        """input_ids, positions [T] ([3, T] with M-RoPE) -> final hidden states [T, E] and the updated cache.
        `metadata` names pages 0..pages_per_layer-1; each layer reads and writes its own range of the cache.
        inputs_embeds [T, E]: instead of the token embeddings; deepstack [D, T, E]: as in `__call__`; lora [T]:
        each token's adapter slot, -1 for none (a model with LoRA tables: `jaxllm.models.lora.enable`).
        capture: layer indices, ascending; with them a third output [T, len(capture) * E], the residual stream
        entering each of those layers side by side (what an EAGLE-3 head reads: `jaxllm.speculative.eagle3`)."""
        attn_fn = attention_kernel(self.kernels)
        rope = self._rope(positions)
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        _, total_pages, page_size, _ = kv_cache[0].shape
        pages_per_layer = total_pages // self.config.num_layers

        def run(layer, x, kv, index):
            meta = metadata.offset_pages(index * pages_per_layer, page_size)
            window = self.window(index)
            cos, sin = self.layer_rope(rope, index)
            if lora is None:
                x, kv = layer(x, lambda attn, h: attn.paged(h, cos, sin, kv, meta, attn_fn, window))
            else:
                x, kv = layer(x, lambda attn, h: attn.paged(h, cos, sin, kv, meta, attn_fn, window, lora), lora)
            return _add_deepstack(x, deepstack, index), kv

        if not capture:
            x, kv_cache = self._run_layers(run, x, kv_cache)
            return self.norm(x), kv_cache
        # [len(capture) + 1, T, E]: a captured layer's input goes to its row, any other layer's to the spare last
        # row (one in-place row write a layer, whether the layers are scanned or unrolled)
        row_of = [len(capture)] * self.config.num_layers
        for j, index in enumerate(capture):
            row_of[index] = j

        def run_capturing(layer, x, carry, index):
            kv, seen = carry
            row = row_of[index] if isinstance(index, int) else jnp.asarray(row_of, jnp.int32)[index]
            seen = jax.lax.dynamic_update_index_in_dim(seen, x.astype(seen.dtype), row, 0)
            x, kv = run(layer, x, kv, index)
            return x, (kv, seen)

        seen = jnp.zeros((len(capture) + 1, *x.shape), x.dtype)
        x, (kv_cache, seen) = self._run_layers(run_capturing, x, (kv_cache, seen))
        features = jnp.moveaxis(seen[:-1], 0, 1).reshape(x.shape[0], -1)  # [T, len(capture) * E]
        return self.norm(x), kv_cache, features


def _family_parts(cfg: ModelConfig) -> dict:
    """The layer factories of cfg's family (Llama's for an architecture no family registered: a config a caller
    built by hand)."""
    from jaxllm.models.registry import ARCHITECTURES

    spec = ARCHITECTURES.get(cfg.architecture)
    return {} if spec is None else {k: v for k, v in (("attention", spec.attention), ("mlp", spec.mlp)) if v}


def _add_deepstack(x: jax.Array, deepstack: jax.Array | None, index) -> jax.Array:
    """x plus deepstack[index] after the first D layers (index may be a scan's traced counter)."""
    if deepstack is None:
        return x
    d = deepstack.shape[0]
    extra = deepstack[jnp.minimum(index, d - 1)].astype(x.dtype)
    return x + jnp.where(index < d, extra, jnp.zeros_like(extra))
