"""Weights interleaved by 16 rows (`interleave`) and the int8 kernel's loops for them (`cpu_x16_kernel`): the layout
converts both ways and every reader of a weight (dequantize, row tiles, row lookups) gets the same values from
it; the kernel is exact where the arithmetic is, close to the float64 product otherwise, batch invariant, and
bit-identical to the amx path (the same block sums and float work) where this CPU runs both."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from pallas_kernels.quantized_matmul import activations, cpu, isa, reference
from pallas_kernels.quantized_matmul.cpu_x16_kernel import MAX_INPUTS
from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.interleave import deinterleave, deinterleave_jnp, interleave, supports
from tests.pallas_kernels.quantized_matmul.test_matmul import _case

X16_KINDS = [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q5_K]  # the 32-value groups; Q6_K (16) and int8 (per row) are not


def _x16(w, fmt):
    return jax.tree.map(jnp.asarray, interleave(jax.tree.map(np.asarray, w), fmt)), dataclasses.replace(
        fmt, interleaved=True)


def _path():
    for path in cpu.X16_ISAS:
        if isa.supported(path):
            return path
    pytest.skip(f"no path with interleaved loops on this CPU ({isa.describe()})")


@functools.cache
def _matmul(path):
    return jax.jit(functools.partial(cpu.matmul, isa=path), static_argnums=2)


@pytest.mark.parametrize("kind", X16_KINDS, ids=lambda k: k.name)
def test_the_layout_round_trips_and_every_reader_sees_the_same_weight(kind):
    w, fmt, _ = _case(kind, (2, 1040, 256))  # a layer stack; 1040 rows: row tiles of whole 16-row groups
    assert supports(fmt, 1040) and not supports(fmt, 1032)
    wx, fx = _x16(w, fmt)
    assert all(a is None or a.shape == b.shape for a, b in zip(wx, w, strict=True))
    assert not np.array_equal(np.asarray(wx.data), np.asarray(w.data))  # really moved
    for back in (deinterleave(jax.tree.map(np.asarray, wx), fmt), deinterleave_jnp(wx, fmt)):
        for a, b in zip(back, w, strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(reference.dequantize(wx, fx), reference.dequantize(w, fmt))
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32))
    for layer in (0, 1):
        np.testing.assert_array_equal(reference.tiled_matmul(x, wx, fx, jnp.int32(layer)),
                                      reference.tiled_matmul(x, w, fmt, jnp.int32(layer)))
    one = jax.tree.map(lambda a: None if a is None else a[1], wx, is_leaf=lambda a: a is None)
    plain = jax.tree.map(lambda a: None if a is None else a[1], w, is_leaf=lambda a: a is None)
    ids = jnp.asarray([[0, 15, 16, 1039], [517, 3, 3, 1024]])
    np.testing.assert_array_equal(reference.take_rows(one, fx, ids), reference.take_rows(plain, fmt, ids))


def test_formats_refuse_what_cannot_be_interleaved():
    with pytest.raises(ValueError, match="grouped by 32"):
        QuantFormat(8, 16, False, "float32", interleaved=True)
    fmt = QuantFormat(4, 32, True, "float16")
    with pytest.raises(ValueError, match="not joined"):
        dataclasses.replace(fmt, interleaved=True).join(fmt)
    w, fmt, _ = _case(T.Q4_1, (24, 64))
    with pytest.raises(ValueError, match="cannot be interleaved"):
        interleave(jax.tree.map(np.asarray, w), fmt)


@pytest.mark.parametrize("fmt", [QuantFormat(4, 32, True, "float16"), QuantFormat(4, 32, False, "float16"),
                                 QuantFormat(8, 32, False, "float16"), QuantFormat(8, 32, True, "float32")],
                         ids=lambda f: f.label)
def test_exact_where_every_operation_is(fmt):
    """Power-of-two scales and offsets, inputs that quantize exactly: every product and partial sum is
    representable, so the kernel must equal the float64 result bit for bit (a lane, word, block, scale or
    offset taken from the wrong place would not)."""
    path = _path()
    rng = np.random.default_rng(4)
    out, n = 48, 576
    q = rng.integers(0, 16, (out, n)) if fmt.bits == 4 else rng.integers(-128, 128, (out, n))
    groups = n // 32
    scale = 2.0 ** rng.integers(-4, 2, (out, groups))
    offset = -(2.0 ** rng.integers(-3, 1, (out, groups))) if fmt.affine else None
    if fmt.bits == 4:
        nib = q.reshape(out, groups, 2, 16)
        data = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(out, n // 2).astype(np.uint8)
        values = (q - (0 if fmt.affine else 8)).astype(np.float64)
    else:
        data, values = q.astype(np.int8), q.astype(np.float64)
    wf = values * np.repeat(scale, 32, axis=1) + (0 if offset is None else np.repeat(offset, 32, axis=1))
    dt = np.dtype(fmt.scale_dtype)
    w = QuantizedWeight(data, scale.astype(dt), None if offset is None else offset.astype(dt))
    wx, fx = _x16(w, fmt)
    for rows in (1, 5, MAX_INPUTS + 3):  # one input, a pass, a pass and a tail
        x = rng.integers(-127, 128, (rows, n)).astype(np.float64)
        x.reshape(rows, n // 32, 32)[:, :, 0] = 127
        x *= 2.0 ** rng.integers(-3, 3, (rows, 1))
        y = np.asarray(_matmul(path)(jnp.asarray(x.astype(np.float32)), wx, fx))
        np.testing.assert_array_equal(y, (x @ wf.T).astype(np.float32))


@pytest.mark.parametrize("kind", X16_KINDS, ids=lambda k: k.name)
def test_close_to_the_float64_product_batch_invariant_and_equal_to_amx(kind):
    path = _path()
    w, fmt, wf = _case(kind, (2, 96, 768))
    wx, fx = _x16(w, fmt)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((40, 768)).astype(np.float32))
    fn = _matmul(path)
    together = np.asarray(fn(x, wx, fx, jnp.int32(1)))
    xa = activations.dequantize(activations.quantize(x)).astype(np.float64)
    exact = xa @ np.asarray(wf[1], np.float64).T
    assert np.all(np.abs(together - exact) <= 2e-6 * 768 ** 0.5 * (np.abs(xa) @ np.abs(wf[1].T)) + 1e-30)
    for n in (1, 2, 7, 8, 9, 17):
        np.testing.assert_array_equal(np.asarray(fn(x[:n], wx, fx, jnp.int32(1))), together[:n])
    np.testing.assert_array_equal(np.asarray(fn(x[11:12], wx, fx, jnp.int32(1)))[0], together[11])
    if isa.supported("amx"):
        np.testing.assert_array_equal(np.asarray(_matmul("amx")(x, w, fmt, jnp.int32(1))), together)


def test_without_its_loops_an_interleaved_weight_runs_the_reference():
    w, fmt, wf = _case(T.Q4_1, (64, 256))
    wx, fx = _x16(w, fmt)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32))
    for path in (None, "avx2"):  # float activations; a lane path without interleaved loops
        y = np.asarray(jax.jit(functools.partial(cpu.matmul, isa=path), static_argnums=2)(x, wx, fx))
        np.testing.assert_allclose(y, np.asarray(x) @ wf.T, rtol=1e-4, atol=1e-4)
