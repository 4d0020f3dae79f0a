"""The skinny matmul on CPU: an XLA FFI custom call into `cpu_kernel`, its row chunks shared between the
calling thread and XLA's thread pool (`pallas_kernels.cpu_ffi.parallel_for`, split: each thread streams its own
contiguous share of the weight rows, then steals what is left of the others').

For float32 on the CPU backend with at most MAX_ROWS input rows; anything else runs the reference (XLA's dot,
which is faster once there are enough rows to reuse each weight from cache). A SmolLM2 single-token step's
matmuls (120 linears and the tied LM head, 538 MB of weights): 25.0 ms with XLA's dot, 21.6 ms with this
kernel; at 2-8 tokens 39-47 vs 26-38 ms (`benchmarks/matmul.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.skinny_matmul.reference import matmul as reference_matmul

TARGET = "jaxllm_cpu_skinny_matmul"
MAX_ROWS = 8


def _load_handler():
    from pallas_kernels.skinny_matmul.cpu_kernel import handler
    return handler


def register() -> None:
    """Loads the kernel (compiled by numba, or from its disk cache) and registers the FFI target, once per process."""
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)


def applies(x: jax.Array, w: jax.Array) -> bool:
    rows = int(np.prod(x.shape[:-1]))
    return (x.dtype == w.dtype == jnp.float32 and 0 < rows <= MAX_ROWS and w.ndim == 2
            and jax.default_backend() == "cpu")


@jax.custom_vjp
def _kernel(x: jax.Array, w: jax.Array) -> jax.Array:  # [T, in], [out, in] -> [T, out]
    register()
    return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))(x, w)


def _kernel_fwd(x, w):
    return _kernel(x, w), (x, w)


def _kernel_bwd(residuals, g):  # a notebook may differentiate through the model: plain matmuls backwards
    x, w = residuals
    return g @ w, g.T @ x


_kernel.defvjp(_kernel_fwd, _kernel_bwd)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out, in]^T -> [..., out]; the kernel for float32 with at most MAX_ROWS rows."""
    if not applies(x, w):
        return reference_matmul(x, w)
    return _kernel(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])
