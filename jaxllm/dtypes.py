"""dtype policy: float32 where there is no fast bfloat16 (CPU), bfloat16 on GPU and TPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str | None = "auto", backend: str | None = None):
    if name in (None, "auto"):
        return jnp.float32 if (backend or jax.default_backend()) == "cpu" else jnp.bfloat16
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}") from None
