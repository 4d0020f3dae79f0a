"""A quantized layer's matmul and its adapter term in one XLA FFI custom call on CPU (`cpu_fused_kernel`), for
steps of up to MAX_TOKENS tokens (decode batches) where both kernels would run anyway: the int8-activation
quantized matmul (`pallas_kernels.quantized_matmul.cpu`) and the adapter-term kernel (`cpu`). Its result has the
bits of theirs added by XLA, so a token's output does not depend on which of the two ways its step took; a layer
with a bias keeps them apart (the bias comes between the two in that sum)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora_delta import cpu as lora_cpu
from pallas_kernels.quantized_matmul import activations
from pallas_kernels.quantized_matmul import cpu as matmul_cpu
from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight

MAX_TOKENS = 64  # a longer step keeps the two calls: the kernel adds the term to the output on one thread


def target(isa: str, interleaved: bool) -> str:
    return f"jaxllm_cpu_q8act_{'x16_' if interleaved else ''}lora_matmul_{isa}"


def register_all(isa: str) -> None:
    """Registers `isa`'s targets (the lane loops', and the interleaved loops' where the path has them)."""
    for interleaved in (False, True):
        if not interleaved or isa in matmul_cpu.X16_ISAS:
            register(isa, interleaved)


def register(isa: str, interleaved: bool) -> None:
    from pallas_kernels.cpu_ffi import register_once

    def load():
        from pallas_kernels.lora_delta.cpu_fused_kernel import handler
        return handler(isa, interleaved)
    register_once(target(isa, interleaved), load)


def applies(x: jax.Array, fmt: QuantFormat, isa: str | None, a: jax.Array, b: jax.Array) -> bool:
    """Whether both kernels would take this call: an int8 path for x and fmt (the interleaved loops where the
    weight is interleaved), and tables the term's kernel reads."""
    if isa is None or x.ndim != 2 or not 0 < x.shape[0] <= MAX_TOKENS or not matmul_cpu.int8_applies(x, fmt) \
            or not lora_cpu.applies(x, a, b):
        return False
    return not fmt.interleaved or isa in matmul_cpu.X16_ISAS


def matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, layer: jax.Array | int, a: jax.Array, b: jax.Array,
           lora_layer: jax.Array | int, slots: jax.Array, parts: np.ndarray | None, *, isa: str) -> jax.Array:
    """x [T, in] @ dequantize(w)^T + each token's adapter term -> [T, out] float32: w's arrays stacks [layers, ...]
    read at `layer`, a [L, S, P * R, in] and b [L, S, R, out] read at `lora_layer`, slots [T] int32 (-1: none),
    parts as `cpu.lora_delta`'s. The caller checks `applies`."""
    register(isa, fmt.interleaved)
    data, scale, offset = w
    if offset is None:
        offset = jnp.zeros((*scale.shape[:-1], 0), scale.dtype)
    t, n = x.shape
    out = (jax.ShapeDtypeStruct((t, data.shape[1]), jnp.float32), jax.ShapeDtypeStruct((t, n), jnp.int8),
           *[jax.ShapeDtypeStruct((t, n // activations.BLOCK), jnp.float32)] * 2,
           jax.ShapeDtypeStruct((t, a.shape[2]), jnp.float32), jax.ShapeDtypeStruct((t, data.shape[1]), jnp.float32))
    y, *_ = jax.ffi.ffi_call(target(isa, fmt.interleaved), out)(
        x, data, scale, offset, jnp.asarray(layer, jnp.int32), a, b, jnp.asarray(lora_layer, jnp.int32),
        slots.astype(jnp.int32), jnp.asarray(lora_cpu.parts_operand(parts)))
    return y
