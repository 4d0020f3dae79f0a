"""The CPU skinny-matmul kernel (numba behind an XLA custom call, row chunks shared with XLA's thread pool)
against numpy, its fallbacks, its gradient, and the row independence that keeps batches invariant."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_ffi import busy_slots
from pallas_kernels.skinny_matmul import cpu, reference
from pallas_kernels.skinny_matmul.cpu_kernel import ROWS_PER_CHUNK


def _inputs(t, n, o, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((t, n)).astype(np.float32), rng.standard_normal((o, n)).astype(np.float32)


# out sizes: below a chunk, not a multiple of 4, several chunks with a ragged last one, a vocabulary-sized head
@pytest.mark.parametrize("t", [1, 2, 3, 8])
@pytest.mark.parametrize(("n", "o"), [(5, 3), (64, 4 * ROWS_PER_CHUNK + 7), (576, 960), (96, 12_345)])
def test_matches_numpy(t, n, o):
    x, w = _inputs(t, n, o)
    got = np.asarray(jax.jit(cpu.matmul)(x, w))
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.sqrt(n))
    assert busy_slots() == 0


def test_leading_dimensions_are_kept():
    x, w = _inputs(6, 32, 40)
    got = cpu.matmul(jnp.asarray(x).reshape(2, 3, 32), jnp.asarray(w))
    assert got.shape == (2, 3, 40)
    np.testing.assert_allclose(np.asarray(got).reshape(6, 40), x @ w.T, rtol=1e-5, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Each output is one fixed-order dot product: the same bits alone or among 7 other rows (what keeps a
    request's greedy output the same whatever else is in its batch)."""
    x, w = _inputs(8, 576, 1536)
    together = np.asarray(cpu.matmul(x, w))
    for i in range(8):
        assert np.array_equal(np.asarray(cpu.matmul(x[i:i + 1], w))[0], together[i])


def _lowered(x, w):
    return jax.jit(cpu.matmul).lower(x, w).as_text()


def test_the_kernel_runs_only_where_it_applies():
    x, w = _inputs(cpu.MAX_ROWS, 16, 24)
    assert cpu.TARGET in _lowered(x, w)
    assert cpu.TARGET not in _lowered(np.concatenate([x, x]), w)  # more rows: XLA's dot reuses weights better
    assert cpu.TARGET not in _lowered(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16))
    big = np.concatenate([x, x])
    np.testing.assert_allclose(np.asarray(cpu.matmul(big, w)), np.asarray(reference.matmul(big, w)), rtol=1e-6)


def test_gradients_match_the_reference():
    x, w = _inputs(3, 48, 20)

    def loss(fn):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(fn(x, w))), argnums=(0, 1))(x, w)

    for got, expected in zip(loss(cpu.matmul), loss(reference.matmul), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_concurrent_callers_share_the_pool_safely():
    """Two Python threads running kernels at once (each launch claims its own slot)."""
    import threading
    x, w = _inputs(2, 256, 3000)
    fn = jax.jit(cpu.matmul)
    expected = np.asarray(fn(x, w))
    errors = []

    def run():
        for _ in range(20):
            if not np.array_equal(np.asarray(fn(x, w)), expected):
                errors.append("mismatch")

    threads = [threading.Thread(target=run) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    assert busy_slots() == 0


@pytest.mark.parametrize("t", [1, 5, cpu.MAX_ROWS])
def test_a_layer_of_a_stacked_weight_is_read_in_place(t):
    """Given the stack [layers, out, in] and a traced layer index (as inside the scanned decoder), the kernel reads
    that layer's weight, and the custom call's operand is the whole stack, not a copied slice."""
    rng = np.random.default_rng(1)
    stacked = rng.standard_normal((4, 40, 24)).astype(np.float32)
    x = rng.standard_normal((t, 24)).astype(np.float32)
    run = jax.jit(cpu.matmul)
    for layer in range(4):
        got = np.asarray(run(x, stacked, jnp.int32(layer)))
        np.testing.assert_allclose(got, x @ stacked[layer].T, rtol=1e-5, atol=1e-5)
        assert np.array_equal(got, np.asarray(cpu.matmul(x, stacked[layer])))  # the same bits as unstacked
    hlo = jax.jit(cpu.matmul).lower(x, stacked, jnp.int32(0)).compile().as_text()
    call = next(line for line in hlo.splitlines() if cpu.TARGET in line)
    assert "f32[4,40,24]" in call
    # Out of range indices clamp as XLA's dynamic slices do.
    np.testing.assert_allclose(np.asarray(run(x, stacked, jnp.int32(9))), x @ stacked[3].T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(run(x, stacked, jnp.int32(-2))), x @ stacked[0].T, rtol=1e-5, atol=1e-5)


def test_gradients_through_a_stacked_weight():
    rng = np.random.default_rng(2)
    stacked = jnp.asarray(rng.standard_normal((3, 20, 16)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((2, 16)).astype(np.float32))

    def loss(fn, x, w):
        return jnp.sum(jnp.sin(fn(x, w, jnp.int32(1))))

    got = jax.grad(lambda x, w: loss(cpu.matmul, x, w), argnums=(0, 1))(x, stacked)
    want = jax.grad(lambda x, w: loss(reference.matmul, x, w), argnums=(0, 1))(x, stacked)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[1])[[0, 2]])  # only the layer used gets a gradient
