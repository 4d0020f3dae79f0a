"""The Pallas GPU skinny matmul (`pallas_kernels.skinny_matmul.gpu`), in Pallas' interpreter here: its products
against float64, the rows past a step's count never read or written, a row's bits independent of the rows beside
it, split-K, the block-size rule, its fallbacks to XLA's dot, and its lowering for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.skinny_matmul import gpu
from pallas_kernels.skinny_matmul.reference import matmul as reference

BF16 = jnp.bfloat16


def _inputs(t, n, k, dtype=BF16, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((t, k)), dtype), jnp.asarray(rng.standard_normal((n, k)) * 0.1, dtype))


def _rel_err(got, x, w):
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize(("t", "n", "k", "sm_count", "dtype"), [
    (1, 384, 256, 4, BF16),  # one split
    (3, 512, 1024, 64, BF16),  # split-K: 64 programs wanted, 512 / 32 columns give 16
    (16, 96, 192, 4, BF16),  # the most rows; an input width that takes a narrower block_k
    (5, 64, 1024, 32, jnp.float16),
])
def test_products_match_float64(t, n, k, sm_count, dtype):
    x, w = _inputs(t, n, k, dtype)
    sizes = gpu.block_sizes(n, k, sm_count=sm_count)
    got = gpu.matmul(x, w, sizes=sizes, interpret=True)
    assert got.shape == (t, n) and got.dtype == dtype
    assert _rel_err(got, x, w) < 4e-3  # the output's own rounding (bfloat16: ~2e-3)
    if sm_count > 8:
        assert sizes.splits > 1, sizes


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    """Every step of 1..16 rows runs the same 16-row tile: a decode row's output is the same whatever batch it
    shares (speculative decoding and batch-invariant serving rely on this)."""
    x, w = _inputs(9, 256, 512, seed=1)
    sizes = gpu.block_sizes(256, 512, sm_count=16)
    whole = np.asarray(gpu.matmul(x, w, sizes=sizes, interpret=True))
    for rows in (1, 4):
        part = np.asarray(gpu.matmul(x[:rows], w, sizes=sizes, interpret=True))
        assert (part == whole[:rows]).all(), rows


def test_leading_dimensions_and_a_layer_of_a_stack():
    x, w = _inputs(4, 128, 256)
    stack = jnp.stack([w * 2, w])
    got = gpu.matmul(x.reshape(2, 2, 256), stack, jnp.int32(1), interpret=True)
    assert got.shape == (2, 2, 128)
    assert _rel_err(got.reshape(4, 128), x, w) < 4e-3


@pytest.mark.parametrize(("t", "n", "k", "dtype"), [
    (gpu.MAX_ROWS + 1, 128, 256, BF16),  # a prefill-sized step: XLA's GEMM reuses each weight tile
    (2, 128, 256, jnp.float32),  # float32 keeps XLA's dot at its precision
    (2, 100, 256, BF16),  # no tiling of 100 output columns
])
def test_what_the_kernel_does_not_fit_runs_xlas_dot(t, n, k, dtype):
    x, w = _inputs(t, n, k, dtype)
    assert not gpu.applies(x, w)
    hlo = jax.jit(lambda x, w: gpu.matmul(x, w, interpret=True)).lower(x, w).as_text()
    assert "skinny_matmul_gpu" not in hlo and "dot_general" in hlo
    assert (gpu.matmul(x, w) == reference(x, w)).all()


@pytest.mark.parametrize(("name", "n", "k"), [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096),
                                               ("down", 4096, 14336), ("lm_head", 128256, 4096)])
def test_the_block_rule_fills_an_h100_at_llama_8b_shapes(name, n, k):
    sizes = gpu.block_sizes(n, k)
    assert n % sizes.block_n == 0 and k % (sizes.block_k * sizes.splits) == 0
    assert (n // sizes.block_n) * sizes.splits >= gpu.SM_COUNT and sizes.splits == 1  # no partials to add


def test_it_lowers_for_cuda():
    x = jax.ShapeDtypeStruct((1, 4096), BF16)
    w = jax.ShapeDtypeStruct((4096, 14336), BF16)  # the down projection: split-K, partials summed after
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exported = jax.export.export(jax.jit(lambda x, w: gpu.matmul(x, w)), platforms=["cuda"],
                                 disabled_checks=[triton])(x, w)
    text = exported.mlir_module()
    assert "skinny_matmul_gpu" in text and "__gpu$xla.gpu.triton" in text
