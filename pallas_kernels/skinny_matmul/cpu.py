"""The skinny matmul on CPU: an XLA FFI custom call into `cpu_kernel`, its row chunks shared between the
calling thread and XLA's thread pool (`pallas_kernels.cpu_ffi.parallel_for`, split: each thread streams its own
contiguous share of the weight rows, then steals what is left of the others').

For float32 on the CPU backend with at most MAX_ROWS input rows (decode batches); anything else runs the
reference (XLA's dot, faster once there are enough rows to reuse each weight from cache: prefill chunks). The
kernel also reads one layer of a stacked weight in place, which XLA:CPU's dot cannot (it copies a dynamic slice
first): the scanned decoder's matmuls at up to 32 rows are faster through it than XLA's dot on separate weights
(`benchmarks/matmul.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.skinny_matmul.reference import matmul as reference_matmul

TARGET = "jaxllm_cpu_skinny_matmul"
MAX_ROWS = 32


def _load_handler():
    from pallas_kernels.skinny_matmul.cpu_kernel import handler
    return handler


def register() -> None:
    """Loads the kernel (compiled by numba, or from its disk cache) and registers the FFI target, once per process."""
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)


def applies(x: jax.Array, w: jax.Array) -> bool:
    rows = int(np.prod(x.shape[:-1]))
    return x.dtype == w.dtype == jnp.float32 and 0 < rows <= MAX_ROWS and w.ndim in (2, 3)


@jax.custom_vjp
def _kernel(x: jax.Array, w: jax.Array, layer: jax.Array) -> jax.Array:  # [T, in], [L, out, in], [] -> [T, out]
    register()
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))(x, w, layer)


def _kernel_fwd(x, w, layer):
    return _kernel(x, w, layer), (x, w, layer)


def _kernel_bwd(residuals, g):  # a notebook may differentiate through the model: plain matmuls backwards
    x, w, layer = residuals
    w_layer = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    dw = jax.lax.dynamic_update_index_in_dim(jnp.zeros_like(w), g.T @ x, layer, 0)
    return g @ w_layer, dw, np.zeros(layer.shape, jax.dtypes.float0)


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out]; with `layer`, w is a stack [layers, out, in] and w[layer] is read
    in place (the kernel is given the stack and the index: a sliced operand would be copied first). The kernel
    for float32 with at most MAX_ROWS rows; the reference otherwise."""
    if not applies(x, w):
        return reference_matmul(x, w, layer)
    stack = w if layer is not None else w[None]
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    return _kernel(x.reshape(-1, x.shape[-1]), stack, index).reshape(*x.shape[:-1], stack.shape[1])
