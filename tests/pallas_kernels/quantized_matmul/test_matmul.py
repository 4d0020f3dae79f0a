"""The quantized matmuls (CPU kernel, jnp reference, row-tiled path) against float matmul with `gguf.quants`'s
dequantized weights, for every GGUF type kept quantized and for per-channel int8, over the shape classes the
engine uses: decode rows (1, a few, 32), prefill rows (several input blocks; XLA tiles), a layer of a stack read
in place, row counts that are not multiples of the kernel's 4-row blocks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from jaxllm.loading.gguf_quant import FORMATS, repack
from jaxllm.loading.quantize import dequantize, quantize_int8
from pallas_kernels.quantized_matmul import cpu, reference
from pallas_kernels.quantized_matmul.format import INT8
from tests.quant_blocks import QTYPES, random_blocks

IMPLS = {"cpu": cpu.matmul, "reference": reference.matmul, "tiled": reference.tiled_matmul}


def _case(kind, shape, seed=0):
    """(QuantizedWeight of jax arrays, format, float32 weights as gguf dequantizes them)."""
    if kind == "int8":
        w = quantize_int8(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
        return jax.tree.map(jnp.asarray, w), INT8, dequantize(w, INT8)
    raw = random_blocks(kind, shape, seed)
    return jax.tree.map(jnp.asarray, repack(raw, kind, shape)), FORMATS[kind], gguf_dequantize(raw, kind)


def _check(y, x, wf):
    """Equal to the float64 product up to float32 rounding of each output's terms."""
    exact = x.astype(np.float64) @ np.swapaxes(wf, -1, -2).astype(np.float64)
    bound = 2e-6 * x.shape[-1] ** 0.5 * (np.abs(x) @ np.abs(np.swapaxes(wf, -1, -2))) + 1e-30
    assert np.all(np.abs(np.asarray(y, np.float64) - exact) <= bound), np.max(np.abs(y - exact) / bound)


KINDS = [*QTYPES, "int8"]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "name", k))
@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("rows", [1, 7, 32, 45, 300])
def test_matches_float_matmul_of_dequantized_weights(kind, impl, rows):
    w, fmt, wf = _case(kind, (1030, 512))  # 1030 rows: 4-row blocks plus a tail, two 512-row-ish tiles
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    y = jax.jit(IMPLS[impl], static_argnums=2)(jnp.asarray(x), w, fmt)
    assert y.shape == (rows, 1030) and y.dtype == jnp.float32
    _check(np.asarray(y), x, wf)


@pytest.mark.parametrize("kind", [QTYPES[2], QTYPES[5], "int8"], ids=lambda k: getattr(k, "name", k))
@pytest.mark.parametrize("impl", list(IMPLS))
def test_one_layer_of_a_stack_is_read_in_place(kind, impl):
    w, fmt, wf = _case(kind, (3, 64, 256))
    x = np.random.default_rng(1).standard_normal((2, 256)).astype(np.float32)
    for layer in range(3):
        y = jax.jit(IMPLS[impl], static_argnums=2)(jnp.asarray(x), w, fmt, jnp.int32(layer))
        _check(np.asarray(y), x, wf[layer])


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "name", k))
def test_cpu_kernel_rows_do_not_depend_on_the_batch(kind):
    """Batch invariance: each row's result is bit-identical whether it runs alone or among others, from decode
    steps to prefill-sized ones (inputs in several L2 blocks, paired or not)."""
    w, fmt, _ = _case(kind, (98, 512))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((300, 512)).astype(np.float32))
    f = jax.jit(cpu.matmul, static_argnums=2)
    together = np.asarray(f(x, w, fmt))
    for n in (1, 3, 17, 32, 129):
        np.testing.assert_array_equal(np.asarray(f(x[:n], w, fmt)), together[:n])
    np.testing.assert_array_equal(np.asarray(f(x[5:6], w, fmt))[0], together[5])


def test_embedding_rows_dequantize_exactly():
    w, fmt, wf = _case(QTYPES[0], (50, 64))  # Q8_0, as the embedded model's table
    ids = jnp.asarray([[3, 49, 0]])
    np.testing.assert_array_equal(np.asarray(reference.take_rows(w, fmt, ids)), wf[np.asarray(ids)])
