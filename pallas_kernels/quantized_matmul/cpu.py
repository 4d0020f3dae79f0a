"""The quantized matmul on CPU: an XLA FFI custom call for every step shape (decode, batches, prefill chunks), its
row chunks shared between the calling thread and XLA's thread pool like the float32 skinny kernel's.

Two kernels, one per kind of activation:
- `cpu_int8_kernel` (with an integer dot-product path, `isa`): the activations quantized per 32 values to int8
  in the step (`activations`), integer dot products against the weights' own integers, as llama.cpp does;
- `cpu_kernel` (float activations): each weight dequantized to float32 and multiplied by the float input.
A weight interleaved by 16 rows (`interleave`: what the engine loads for an int8 path in X16_ISAS) runs that
path's interleaved loops (`cpu_x16_kernel`); without them, `reference.tiled_matmul` reads it.
Either runs one kernel for every row count, which is what makes quantized outputs batch invariant: a row's
result is bit-identical whether its step has 1 row or 4096 (switching to XLA's dot above some size would round
differently). Inputs a kernel does not take (not float32, rows not a multiple of its blocks, an int8 path for a
format it does not cover) run the float kernel, or `reference.tiled_matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_matmul import activations
from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.reference import grouped_matmul as grouped_reference
from pallas_kernels.quantized_matmul.reference import tiled_matmul

TARGET = "jaxllm_cpu_quantized_matmul"
X16_ISAS = ("vnni512",)  # the int8 paths with loops for weights interleaved by 16 rows (`cpu_x16_kernel`)


def int8_target(isa: str) -> str:
    return f"jaxllm_cpu_q8act_matmul_{isa}"


def x16_target(isa: str) -> str:
    return f"jaxllm_cpu_q8act_x16_matmul_{isa}"


def grouped_target(isa: str) -> str:
    return f"jaxllm_cpu_q8act_grouped_matmul_{isa}"


def _load_handler():
    from pallas_kernels.quantized_matmul.cpu_kernel import handler
    return handler


def register(isa: str | None = None) -> None:
    """Loads the float kernel (compiled by numba, or from its disk cache), and `isa`'s int8 kernel if given, and
    registers their FFI targets, once per process."""
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)
    if isa is not None:
        from pallas_kernels.quantized_matmul.cpu_int8_kernel import handler
        register_once(int8_target(isa), lambda: handler(isa))
        if isa in X16_ISAS:
            register_once(x16_target(isa), lambda: handler(isa, interleaved=True))


def register_grouped(isa: str) -> None:
    """Loads and registers `isa`'s grouped int8 kernel (a mixture of experts'), once per process."""
    from pallas_kernels.cpu_ffi import register_once
    from pallas_kernels.quantized_matmul.cpu_int8_kernel import grouped_handler
    register_once(grouped_target(isa), lambda: grouped_handler(isa))


def applies(x: jax.Array) -> bool:
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == jnp.float32 and rows > 0 and x.shape[-1] % 32 == 0  # pairs of 16-value chunks


def int8_applies(x: jax.Array, fmt: QuantFormat) -> bool:
    """The int8 kernel takes pairs of 32-value blocks and every grouping a format has (16 values: a block's two
    halves, 32 or more, a row), except offsets by 16 (it adds offsets once a block)."""
    return applies(x) and x.shape[-1] % 64 == 0 and not (fmt.group == 16 and fmt.affine)


def _kernel(x, data, scale, offset, layer):  # [T, in], [L, out, P], [L, out, G], [L, out, G or 0], [] -> [T, out]
    register()  # float16 scales go in as they are (a bitcast to uint16 would be a copy of the whole stack)
    out = jax.ShapeDtypeStruct((x.shape[0], data.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, data, scale, offset, layer)


def int8_kernel(isa, x, data, scale, offset, layer, interleaved: bool = False):
    """-> (y, the int8 blocks of x): the kernel quantizes x itself (as `activations.quantize`) into scratch
    outputs the step drops: one custom call, not an XLA fusion before each matmul. interleaved: the weight's
    arrays are interleaved by 16 rows (`interleave`; `isa` one of X16_ISAS)."""
    register(isa)
    t, n = x.shape
    out = (jax.ShapeDtypeStruct((t, data.shape[1]), jnp.float32), jax.ShapeDtypeStruct((t, n), jnp.int8),
           *[jax.ShapeDtypeStruct((t, n // activations.BLOCK), jnp.float32)] * 2)
    target = x16_target(isa) if interleaved else int8_target(isa)
    y, *blocks = jax.ffi.ffi_call(target, out)(x, data, scale, offset, layer)
    return y, activations.Int8Activations(*blocks)


def matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, layer: jax.Array | None = None, *,
           isa: str | None = None) -> jax.Array:
    """x [..., in] @ dequantize(w)[out, in]^T -> [..., out]; with `layer`, w's arrays are stacks [layers, ...]
    read in place at `layer`. isa: the int8 kernel's path (`isa.best()`), None for float activations."""
    if not applies(x) or (fmt.interleaved and not (isa in X16_ISAS and int8_applies(x, fmt))):
        return tiled_matmul(x, w, fmt, layer)
    data, scale, offset = w
    if offset is None:
        offset = jnp.zeros((*scale.shape[:-1], 0), scale.dtype)
    if layer is None:
        data, scale, offset = data[None], scale[None], offset[None]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    x2 = x.reshape(-1, x.shape[-1])
    if isa is not None and int8_applies(x, fmt):
        y = int8_kernel(isa, x2, data, scale, offset, index, fmt.interleaved)[0]
    else:
        y = _kernel(x2, data, scale, offset, index)
    return y.reshape(*x.shape[:-1], data.shape[1])


def grouped_matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, experts: jax.Array,
                   layer: jax.Array | None = None, *, isa: str | None = None) -> jax.Array:
    """`reference.grouped_matmul` on CPU: with an int8 path that takes x and fmt, one custom call groups the rows
    by expert and multiplies each expert's rows by that expert's weights only, read in place in the stack (experts
    without rows are never read), each row's result as `matmul` gives it (the same kernel loop: batch invariant,
    whatever the grouping); else the reference (every expert dequantized)."""
    if isa is None or not int8_applies(x, fmt):
        return grouped_reference(x, w, fmt, experts, layer)
    register_grouped(isa)
    data, scale, offset = w
    if offset is None:
        offset = jnp.zeros((*scale.shape[:-1], 0), scale.dtype)
    if layer is None:
        data, scale, offset = data[None], scale[None], offset[None]
    count = data.shape[1]
    # [layers * experts, out, ...]: a reshape of the stack (no copy); layer l's expert e is matrix l * E + e
    data, scale, offset = (a.reshape(a.shape[0] * count, *a.shape[2:]) for a in (data, scale, offset))
    base = jnp.stack([jnp.asarray(0 if layer is None else layer, jnp.int32) * count, jnp.int32(count)])
    t, n = x.shape
    out = (jax.ShapeDtypeStruct((t, data.shape[1]), jnp.float32), jax.ShapeDtypeStruct((t, n), jnp.int8),
           *[jax.ShapeDtypeStruct((t, n // activations.BLOCK), jnp.float32)] * 2)
    y = jax.ffi.ffi_call(grouped_target(isa), out)(x, data, scale, offset, experts.astype(jnp.int32), base)[0]
    return y.astype(x.dtype)
