"""dtype policy: float32 where there is no fast bfloat16 (CPU), bfloat16 on GPU and TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# KV cache element types: the model's dtype ("auto"), a narrower float, or float8 (values stored unscaled, as vLLM
# does for checkpoints without calibrated KV scales; the kernels read pages and compute in float32).
KV_CACHE_DTYPES = {**DTYPES, "float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}
# LoRA adapter tables (vLLM's lora_dtype): kernels widen 16-bit tables to float32 as they read them
LORA_DTYPES = DTYPES
# MXFP4's 4-bit E2M1 values (sign, two exponent bits, one mantissa bit: the OCP MX spec's FP4), by nibble value
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def resolve_dtype(name: str | None = "auto", backend: str | None = None):
    if name in (None, "auto"):
        return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}") from None


def resolve_kv_cache_dtype(name: str | None, model_dtype):
    """The KV cache's dtype: `name`, or the model's for "auto"/None."""
    if name in (None, "auto"):
        return jnp.dtype(model_dtype).type
    try:
        return KV_CACHE_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of auto, {', '.join(KV_CACHE_DTYPES)}") \
            from None
