"""The adapter term on CPU: an XLA FFI custom call into `cpu_kernel` (two passes shared with XLA's thread pool).
For float32 activations and float32, float16 or bfloat16 tables (widened as they are read), any number of tokens:
each token's own slot is read in place, where the reference gathers a copy of each token's tables (a decode step)
and the model's path for long steps multiplies by every slot (a prefill chunk); other dtypes run the reference.
The tables are given as the whole layer stack and the layer index: a sliced operand would be copied first."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.lora_delta.reference import lora_delta as reference_delta

TARGET = "jaxllm_cpu_lora_delta"
MAX_ROWS = 1 << 16  # a step's tokens (the u scratch is [T, P * R])


def _load_handler():
    from pallas_kernels.lora_delta.cpu_kernel import handler
    return handler


def register() -> None:
    from pallas_kernels.cpu_ffi import register_once
    register_once(TARGET, _load_handler)


TABLE_DTYPES = (jnp.float32, jnp.float16, jnp.bfloat16)


def applies(x: jax.Array, a: jax.Array, b: jax.Array) -> bool:
    return (x.ndim == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == jnp.float32 and a.dtype == b.dtype
            and a.dtype in TABLE_DTYPES)


def parts_operand(parts: np.ndarray | None) -> np.ndarray:
    """The kernel's parts operand: [out] each output's part, [2] gate/up's alternating parts (the kernel reads no
    per-output parts then), [1] one part."""
    rows = np.zeros(1, np.int32) if parts is None else np.asarray(parts, np.int32)
    if parts is not None and len(rows) % 2 == 0 and np.array_equal(rows, np.arange(len(rows)) % 2):
        rows = rows[:2]
    return rows


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, layer: jax.Array, slots: jax.Array,
               parts: np.ndarray | None) -> jax.Array:
    """As `reference.lora_delta`: x [T, in], a [L, S, P * R, in], b [L, S, R, out], layer [], slots [T] -> [T, out]."""
    if not applies(x, a, b):
        return reference_delta(x, a, b, layer, slots, parts)
    register()
    t, out, width = x.shape[0], b.shape[3], a.shape[2]
    rows = parts_operand(parts)
    y, _ = jax.ffi.ffi_call(TARGET, (jax.ShapeDtypeStruct((t, out), jnp.float32),
                                     jax.ShapeDtypeStruct((t, width), jnp.float32)))(
        x, a, b, jnp.asarray(layer, jnp.int32), slots.astype(jnp.int32), jnp.asarray(rows))
    return y
