"""The skinny matmul as a Pallas GPU kernel (Triton backend): ``x [T, in] @ W[out, in]^T`` for decode steps of a
few rows (T <= MAX_ROWS), bfloat16 or float16 weights. Such a step reads every weight once and does almost no
arithmetic, so the kernel is a stream of the weight rows: a program owns a block of ``block_n`` output columns
(weight rows) and, with split-K, a share of the input dimension; it walks that share ``block_k`` at a time, each
``[block_n, block_k]`` tile one tensor-core dot against the step's rows (padded to MIN_ROWS, a tile's smallest M),
with ``num_stages`` tiles in flight. Split-K programs write float32 partials summed afterwards in split order (a
fixed order: the same inputs give the same bits).

Why not cuBLAS: XLA's cuBLAS GEMMs at one row ran the 8B-shaped step's weights at ~2.4 TB/s on an H100
(`benchmarks/device_check.py`'s profile), and small matrices (q/k/v, o: 34-50 MB) do not fill the chip as one
GEMM; here each shape gets a grid of at least two programs per SM (`block_sizes`). Float32 weights keep XLA's
dot (a float32 engine must match the CPU engine bit for bit in its matmuls' precision), and so does anything
the kernel's shapes do not fit (`applies`).

Block sizes are a per-shape decision made when the step is traced, from `BLOCK_TABLE` and the device's SM count.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import take_layer
from pallas_kernels.skinny_matmul.reference import matmul as reference_matmul

SM_COUNT = 132  # H100 / H200 SXM; only the order of magnitude matters (how many programs fill the chip)
MAX_ROWS = 16  # rows (tokens) a step may have for this kernel; more: XLA's GEMM, which reuses each weight tile
MIN_ROWS = 16  # a tensor-core tile's smallest M
DTYPES = (jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_n: int  # output columns (weight rows) per program
    block_k: int  # input columns per loop iteration
    splits: int  # programs along the input dimension
    num_warps: int = 4
    num_stages: int = 4


# (block_n, block_k, num_warps, num_stages): the tile a program streams. block_n is lowered (down to 16) until the
# grid has two programs per SM, and split-K raised only while it has fewer than one: on an H100 at the 8B model's
# shapes (`benchmarks/device_check.py` part 5's sweep, calls queued) 16- and 32-row tiles without splits streamed
# every weight within 7% of its fastest row (64-row tiles too, but o_proj's: 38% slower), at 4 warps and 4-5
# stages (8 warps or 3 stages: up to 53% slower): q/k/v and o at 59-65% of HBM bandwidth, gate/up and down 70-75%,
# the LM head 85%.
BLOCK_TABLE: tuple[int, int, int, int] = (64, 256, 4, 4)


def block_sizes(n: int, k: int, sm_count: int = SM_COUNT, table: tuple[int, int, int, int] = BLOCK_TABLE
                ) -> BlockSizes | None:
    """The block sizes for a [n, k] weight, or None when no tiling fits (n or k not a multiple of 16)."""
    block_n, block_k, warps, stages = table
    while block_n > 16 and n % block_n:
        block_n //= 2
    while block_k > 16 and k % block_k:
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    while block_n > 16 and n % (block_n // 2) == 0 and (n // block_n) < 2 * sm_count:
        block_n //= 2  # narrower tiles before split-K: no partials to write, read back and add
    splits = 1
    while (n // block_n) * splits < sm_count and k % (2 * splits * block_k) == 0 and splits < 8:
        splits *= 2
    return BlockSizes(block_n, block_k, splits, warps, stages)


def applies(x: jax.Array, w: jax.Array) -> bool:
    rows = int(np.prod(x.shape[:-1]))
    return (0 < rows <= MAX_ROWS and x.dtype == w.dtype and any(w.dtype == d for d in DTYPES)
            and block_sizes(w.shape[-2], w.shape[-1]) is not None)


def _kernel(x_ref, w_ref, o_ref, *, t: int, block_k: int, steps: int, partial: bool):
    # x_ref [rows, in] (rows >= t: the tile's rows past the step's t are masked), w_ref [block_n, in],
    # o_ref [rows, block_n] (this split's partials, or the output)
    start = pl.program_id(1) * steps * block_k
    rows, block_n = o_ref.shape
    live = (jnp.arange(rows, dtype=jnp.int32) < t)[:, None]  # [rows, 1]

    def body(i, acc):
        k0 = pl.multiple_of(start + i * block_k, block_k)
        x = pltriton.load(x_ref.at[:, pl.ds(k0, block_k)], mask=live, other=0.0)  # [rows, block_k]
        w = w_ref[:, pl.ds(k0, block_k)]  # [block_n, block_k]
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((rows, block_n), jnp.float32))
    pltriton.store(o_ref, acc if partial else acc.astype(o_ref.dtype), mask=live)


@functools.partial(jax.jit, static_argnames=("sizes", "interpret"))
def _matmul_2d(x: jax.Array, w: jax.Array, sizes: BlockSizes, interpret: bool = False) -> jax.Array:
    t, k = x.shape  # [T, in]
    n = w.shape[0]  # [out, in]
    # a tile of MIN_ROWS rows over the step's t: the rows past t are read masked (no padded copy of x) and
    # never stored
    rows = max(MIN_ROWS, 1 << (t - 1).bit_length())
    partial = sizes.splits > 1
    steps = k // sizes.splits // sizes.block_k
    kernel = functools.partial(_kernel, t=t, block_k=sizes.block_k, steps=steps, partial=partial)
    if partial:
        out_shape = jax.ShapeDtypeStruct((sizes.splits, t, n), jnp.float32)
        out_spec = pl.BlockSpec((None, rows, sizes.block_n), lambda j, s: (s, 0, j))
    else:
        out_shape = jax.ShapeDtypeStruct((t, n), x.dtype)
        out_spec = pl.BlockSpec((rows, sizes.block_n), lambda j, s: (0, j))
    out = pl.pallas_call(
        kernel,
        grid=(n // sizes.block_n, sizes.splits),
        in_specs=[pl.BlockSpec((rows, k), lambda j, s: (0, 0)), pl.BlockSpec((sizes.block_n, k), lambda j, s: (j, 0))],
        out_specs=out_spec,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=sizes.num_warps, num_stages=sizes.num_stages),
        interpret=interpret,
        name="skinny_matmul_gpu",
    )(x, w)
    if partial:  # the splits' partials added in split order
        total = out[0]
        for s in range(1, sizes.splits):
            total = total + out[s]
        out = total.astype(x.dtype)
    return out


def matmul(x: jax.Array, w: jax.Array, layer: jax.Array | None = None, *, sizes: BlockSizes | None = None,
           interpret: bool = False) -> jax.Array:
    """x [..., in], w [out, in] (or [layers, out, in] with `layer`) -> [..., out]; XLA's dot where the kernel
    does not apply (more than MAX_ROWS rows, float32, shapes no tiling fits)."""
    if not applies(x, w):
        return reference_matmul(x, w, layer)
    if layer is not None:
        w = take_layer(w, layer)
    sizes = sizes or block_sizes(*w.shape)
    lead = x.shape[:-1]
    y = _matmul_2d(x.reshape(-1, x.shape[-1]), w, sizes, interpret)
    return y.reshape(*lead, w.shape[0])
