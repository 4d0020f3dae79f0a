"""A mixture of experts' projection in plain XLA: each row of x times its own expert's [out, in] weight, the rows in
any order. The rows are grouped by expert by counting (XLA:CPU cannot serialize a sort's comparator, and the
engine keeps its steps' executables in a cache on disk), multiplied as one grouped matmul
(`jax.lax.ragged_dot_general`: a GEMM per expert on GPU and TPU; on CPU a dense product over every expert, masked),
and put back in row order. What GPU and TPU run, and the reference of the CPU kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dot_precision

# lhs [rows, in] ragged on its rows; rhs [experts, out, in]: contract in with in, one group per expert
_GROUPED = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def group_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """experts [R] (each row's) -> (slot [R]: where each row goes when the rows are grouped by expert, in row
    order within a group; sizes [experts] int32)."""
    one_hot = (experts[:, None] == jnp.arange(num_experts, dtype=experts.dtype)).astype(jnp.int32)  # [R, experts]
    sizes = jnp.sum(one_hot, axis=0)
    rank = jnp.take_along_axis(jnp.cumsum(one_hot, axis=0), experts[:, None], axis=1)[:, 0]  # 1-based, in group
    first = jnp.cumsum(sizes) - sizes  # each group's first slot
    return first[experts] + rank - 1, sizes


def expert_matmul(x: jax.Array, w: jax.Array, experts: jax.Array) -> jax.Array:
    """x [R, in] @ w[experts[r]]^T row by row (w [experts, out, in]) -> [R, out] float32."""
    experts = experts.astype(jnp.int32)
    slot, sizes = group_by_expert(experts, w.shape[0])
    order = jnp.zeros_like(experts).at[slot].set(jnp.arange(x.shape[0], dtype=jnp.int32))  # slot -> row
    y = jax.lax.ragged_dot_general(x[order].astype(w.dtype), w, sizes, _GROUPED, precision=dot_precision(x),
                                   preferred_element_type=jnp.float32)
    return y[slot]
