"""Parameter-holding building blocks. Every parameter carries logical axis names (metadata ``axes``) that
`jaxllm.sharding` maps onto a device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxllm.kernels import choose_kernels, matmul_kernel, quantized_matmul_kernel
from jaxllm.models.stacked_layers import LayerSlice
from pallas_kernels.quantized_matmul import QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.reference import take_rows


def _init(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, std: float | None):
    """Random normal (std) or zeros (std None); with no rngs, only the shape: a loader fills it in."""
    if rngs is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    if std is None:
        return jnp.zeros(shape, dtype)
    return jax.random.normal(rngs.params(), shape, dtype) * std


def _init_quantized(rngs: nnx.Rngs | None, fmt: QuantFormat, out_features: int, in_features: int, std: float):
    """(data, scale, offset) of a quantized [out, in] weight: random values of about `std`, or shapes only."""
    data_shape, scale_shape = fmt.data_shape(out_features, in_features), fmt.scale_shape(out_features, in_features)
    if rngs is None:
        return (jax.ShapeDtypeStruct(data_shape, fmt.data_dtype), jax.ShapeDtypeStruct(scale_shape, fmt.scale_dtype),
                jax.ShapeDtypeStruct(scale_shape, fmt.scale_dtype) if fmt.affine else None)
    levels = 16 if fmt.bits == 4 else 127
    data = jax.random.randint(rngs.params(), data_shape, 0 if fmt.bits == 4 else -levels, levels).astype(fmt.data_dtype)
    step = 2 * std / levels if fmt.bits == 4 else std / 32
    scale = jnp.full(scale_shape, step, fmt.scale_dtype)
    return data, scale, jnp.full(scale_shape, -8 * step, fmt.scale_dtype) if fmt.affine else None


def _scale_axes(axes: tuple[str | None, str | None], fmt: QuantFormat, in_features: int):
    """A scale's axes: the weight's, its input axis only where there is more than one group along it."""
    return (axes[0], axes[1] if fmt.groups(in_features) > 1 else None)


class Linear(nnx.Module):
    """y = x W^T + b with W stored [out, in], as checkpoints ship it. XLA:CPU also runs this contraction
    faster than x @ W[in, out] for 16+ rows (decode batches, prefill): 53 vs 66 ms for a SmolLM2 forward of
    32 tokens (`benchmarks/offline.py` figures in the README). ``kernels`` (set by the model: `jaxllm.kernels`)
    picks the matmul kernel; a Linear built on its own uses the current backend's default.

    With ``quant`` (a `QuantFormat`) the weight is kept quantized: ``weight`` holds the packed values (int8
    [out, in] or uint8 [out, in / 2]), ``weight_scale`` and ``weight_offset`` (affine formats) [out, groups]."""

    def __init__(self, in_features: int, out_features: int, axes: tuple[str | None, str | None], *,
                 bias: bool = False, dtype=jnp.float32, rngs: nnx.Rngs | None, quant: QuantFormat | None = None):
        """axes: logical names of (in, out)."""
        self.quant = quant
        w_axes = (axes[1], axes[0])
        if quant is None:
            self.weight = nnx.Param(_init(rngs, (out_features, in_features), dtype, in_features ** -0.5),  # [out, in]
                                    axes=w_axes)
        else:
            data, scale, offset = _init_quantized(rngs, quant, out_features, in_features, in_features ** -0.5)
            self.weight = nnx.Param(data, axes=w_axes)  # [out, in] int8 or [out, in / 2] uint8
            self.weight_scale = nnx.Param(scale, axes=_scale_axes(w_axes, quant, in_features))  # [out, groups]
            self.weight_offset = None if offset is None else nnx.Param(offset, axes=self.weight_scale.axes)
        self.bias = nnx.Param(_init(rngs, (out_features,), dtype, None), axes=(axes[1],)) if bias else None
        self.kernels = choose_kernels(dtype=dtype)
        # LoRA adapter slots (`jaxllm.models.lora.enable`): tables a [slots, P * R, in], b [slots, R, out]
        self.lora_rank = 0
        self.lora_fused: tuple[int, ...] | None = None  # a fused layer's row layout (`jaxllm.models.lora`)
        self.lora_a, self.lora_b = nnx.data(None), nnx.data(None)

    @property
    def matmul_impl(self) -> str:
        return self.kernels.matmul

    def __call__(self, x: jax.Array, lora_slots: jax.Array | None = None) -> jax.Array:
        """lora_slots [T] int32 (x [T, in]): each row's adapter slot (-1: none), on a layer with LoRA tables."""
        if lora_slots is None or self.lora_a is None:
            return self._base(x)
        from jaxllm.models.lora import delta, fused_matmul
        a, b = self.lora_a.get_value(), self.lora_b.get_value()
        if self.quant is not None and self.bias is None:
            fused = fused_matmul(self.kernels, x, self.quant, *_weight(self.weight, self.weight_scale,
                                                                       self.weight_offset), a, b, lora_slots,
                                 self.lora_fused)
            if fused is not None:
                return fused
        y = self._base(x)
        return y + delta(x, a, b, lora_slots, self.lora_fused, self.kernels.matmul).astype(y.dtype)

    def _base(self, x: jax.Array) -> jax.Array:
        if self.quant is not None:
            y = _quantized_matmul(self.kernels, x, self.quant, self.weight, self.weight_scale, self.weight_offset)
        else:
            w = self.weight.get_value()
            matmul = matmul_kernel(self.kernels)
            if isinstance(w, LayerSlice):  # a layer of a scanned stack: the kernel reads its slice in place
                y = matmul(x, w.stacked, w.index)  # [..., out]
            else:
                y = matmul(x, w)
        return y if self.bias is None else y + self.bias[...]


def _weight(data: nnx.Param, scale: nnx.Param, offset: nnx.Param | None) -> tuple[QuantizedWeight, jax.Array | None]:
    """(the weight's arrays, the layer to read): a layer of a scanned stack as its stacks and index (the kernel reads
    its slice in place), else its own arrays and None."""
    values = [v.get_value() if v is not None else None for v in (data, scale, offset)]
    if isinstance(values[0], LayerSlice):
        return QuantizedWeight(*(None if v is None else v.stacked for v in values)), values[0].index
    return QuantizedWeight(*values), None


def _quantized_matmul(kernels, x, fmt: QuantFormat, data: nnx.Param, scale: nnx.Param, offset: nnx.Param | None):
    w, layer = _weight(data, scale, offset)
    return quantized_matmul_kernel(kernels)(x, w, fmt, layer)


def row_sum(x: jax.Array) -> jax.Array:
    """x [..., n] -> [..., 1]: the sum over the last axis in an order fixed by n alone (halves added while n is
    even, then the rest in order). XLA:CPU picks a reduction's order by the array's shape: its mean over 576
    values rounds differently for fewer than 8 rows than for more, so a row's norm, and the tokens after it,
    would depend on how many rows its step has (a decode, a prefill chunk, a speculative step)."""
    n = x.shape[-1]
    while n > 1 and n % 2 == 0:
        n //= 2
        x = x[..., :n] + x[..., n:]
    total = x[..., 0]
    for i in range(1, n):
        total = total + x[..., i]
    return total[..., None]


class RMSNorm(nnx.Module):
    """offset: None for Llama's norm (the normalised x cast to x's dtype, then times the weight); a float c for
    Gemma's (times c + weight in float32, then cast: `ModelConfig.rms_norm_offset`)."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.float32, rngs: nnx.Rngs | None,
                 offset: float | None = None):
        init = 1.0 - (offset or 0.0)  # a random model's norms start at the identity either way
        weight = jnp.full((dim,), init, dtype) if rngs is not None else jax.ShapeDtypeStruct((dim,), dtype)
        self.weight = nnx.Param(weight, axes=(None,))
        self.eps = eps
        self.offset = offset
        self.kernels = choose_kernels(dtype=dtype)  # the model's choice replaces it (`set_kernels`)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        squares = row_sum(xf * xf) if self.kernels.fixed_order_sums else jnp.sum(xf * xf, axis=-1, keepdims=True)
        xf = xf * jax.lax.rsqrt(squares / xf.shape[-1] + self.eps)
        if self.offset is not None:
            return (xf * (self.offset + self.weight[...].astype(jnp.float32))).astype(x.dtype)
        return (xf.astype(x.dtype) * self.weight[...]).astype(x.dtype)


class Embed(nnx.Module):
    """The token embedding [vocab, embed], also the tied LM head; with ``quant``, kept quantized like `Linear`'s
    weight (rows dequantized as they are looked up)."""

    def __init__(self, vocab: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs | None,
                 quant: QuantFormat | None = None):
        self.quant, self.dtype = quant, dtype
        axes = ("vocab", "embed")
        if quant is None:
            self.embedding = nnx.Param(_init(rngs, (vocab, dim), dtype, 0.02), axes=axes)  # [vocab, embed]
        else:
            data, scale, offset = _init_quantized(rngs, quant, vocab, dim, 0.02)
            self.embedding = nnx.Param(data, axes=axes)
            self.embedding_scale = nnx.Param(scale, axes=_scale_axes(axes, quant, dim))
            self.embedding_offset = None if offset is None else nnx.Param(offset, axes=self.embedding_scale.axes)
        self.kernels = choose_kernels(dtype=dtype)

    @property
    def matmul_impl(self) -> str:
        return self.kernels.matmul

    def _quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.embedding[...], self.embedding_scale[...],
                               None if self.embedding_offset is None else self.embedding_offset[...])

    def __call__(self, ids: jax.Array) -> jax.Array:
        if self.quant is not None:
            return take_rows(self._quantized(), self.quant, ids, self.dtype)
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [..., embed] -> logits [..., vocab] (the embedding is the head's [out, in] weight)."""
        if self.quant is not None:
            return _quantized_matmul(self.kernels, x, self.quant, self.embedding, self.embedding_scale,
                                     self.embedding_offset)
        return matmul_kernel(self.kernels)(x, self.embedding[...])
