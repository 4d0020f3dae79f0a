"""The quantized matmul on CPU: an XLA FFI custom call into `cpu_kernel` for every step shape (decode, batches,
prefill chunks), its row chunks shared between the calling thread and XLA's thread pool like the float32 skinny
kernel's. One kernel for every row count is what makes quantized outputs batch invariant: a row's result is
bit-identical whether its step has 1 row or 4096, where switching to XLA's dot above some size would round
differently; for prefill-sized steps the kernel (weights dequantized into L1 once per block of rows, input rows
in L2-sized blocks) runs as fast as XLA's dot on dequantized tiles (`benchmarks/quantized_matmul.py`). Inputs
it does not take (not float32, or rows not a multiple of 32 values) run `reference.tiled_matmul`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.reference import tiled_matmul

TARGET = "jaxllm_cpu_quantized_matmul"


def _load_handler():
    from pallas_kernels.quantized_matmul.cpu_kernel import handler
    return handler


def register() -> None:
    """Loads the kernel (compiled by numba, or from its disk cache) and registers the FFI target, once per process."""
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)


def applies(x: jax.Array) -> bool:
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == jnp.float32 and rows > 0 and x.shape[-1] % 32 == 0  # pairs of 16-value chunks


def _kernel(x, data, scale, offset, layer):  # [T, in], [L, out, P], [L, out, G], [L, out, G or 0], [] -> [T, out]
    register()  # float16 scales go in as they are (a bitcast to uint16 would be a copy of the whole stack)
    out = jax.ShapeDtypeStruct((x.shape[0], data.shape[1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(x, data, scale, offset, layer)


def matmul(x: jax.Array, w: QuantizedWeight, fmt: QuantFormat, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ dequantize(w)[out, in]^T -> [..., out]; with `layer`, w's arrays are stacks [layers, ...]
    read in place at `layer`. The kernel for float32 inputs; tiles through XLA otherwise."""
    if not applies(x):
        return tiled_matmul(x, w, fmt, layer)
    data, scale, offset = w
    if offset is None:
        offset = jnp.zeros((*scale.shape[:-1], 0), scale.dtype)
    if layer is None:
        data, scale, offset = data[None], scale[None], offset[None]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    y = _kernel(x.reshape(-1, x.shape[-1]), data, scale, offset, index)
    return y.reshape(*x.shape[:-1], data.shape[1])
