"""The int8-activation quantized matmul (`cpu_int8_kernel`) on every integer path this CPU runs (a path it cannot
run is skipped, and says so): exact where the arithmetic is exact, close to the float64 product of the quantized
activations and the dequantized weights otherwise, bit-identical across paths, row counts and input blocks, and
its own quantization of the inputs equal to `activations.quantize`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import choose_kernels
from pallas_kernels.quantized_matmul import activations, cpu, isa
from pallas_kernels.quantized_matmul.cpu_amx_kernel import TOKENS_PER_PASS
from pallas_kernels.quantized_matmul.cpu_int8_kernel import X_BLOCK_BYTES
from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight
from tests.pallas_kernels.quantized_matmul.test_matmul import KINDS, _case


def _path(name):
    if not isa.supported(name):
        pytest.skip(f"this CPU cannot run the {name} path ({isa.describe()})")
    return name


@functools.cache
def _matmul(path):
    return jax.jit(functools.partial(cpu.matmul, isa=path), static_argnums=2)


@pytest.mark.parametrize("path", isa.ISAS)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "name", k))
def test_close_to_the_float64_product_of_the_quantized_operands(path, kind):
    w, fmt, wf = _case(kind, (1030, 768))  # 4-row blocks plus a tail; K-quants come in 256-value blocks
    x = np.random.default_rng(3).standard_normal((37, 768)).astype(np.float32)  # amx: 2 tiles and a tail
    y = np.asarray(_matmul(_path(path))(jnp.asarray(x), w, fmt))
    xa = activations.dequantize(activations.quantize(jnp.asarray(x))).astype(np.float64)
    exact = xa @ wf.T.astype(np.float64)
    bound = 2e-6 * 768 ** 0.5 * (np.abs(xa) @ np.abs(wf.T)) + 1e-30
    assert np.all(np.abs(y - exact) <= bound), np.max(np.abs(y - exact) / bound)


@pytest.mark.parametrize("path", isa.ISAS)
@pytest.mark.parametrize("fmt", [QuantFormat(4, 32, True, "float16"), QuantFormat(4, 32, False, "float16"),
                                 QuantFormat(8, 32, False, "float16"), QuantFormat(8, 16, False, "float32"),
                                 QuantFormat(8, 64, True, "float32"), QuantFormat(8, 0, False, "float32")],
                         ids=lambda f: f.label)
def test_exact_where_every_operation_is(path, fmt):
    """Power-of-two scales and offsets, inputs whose blocks quantize exactly (integers, max 127 * 2^k): every
    product and partial sum is representable, so the kernel must equal the float64 result bit for bit. Catches
    a lane, block, scale or offset taken from the wrong place."""
    rng = np.random.default_rng(4)
    out, n = 36, 576
    lo, hi = (0, 16) if fmt.bits == 4 else (-128, 128)
    q = rng.integers(lo, hi, (out, n))
    groups = fmt.groups(n)
    scale = 2.0 ** rng.integers(-4, 2, (out, groups))
    offset = -(2.0 ** rng.integers(-3, 1, (out, groups))) if fmt.affine else None
    if fmt.bits == 4:
        nib = q.reshape(out, n // 32, 2, 16)  # value i of a group: low nibble of byte i, i + 16: high nibble
        data = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(out, n // 2).astype(np.uint8)
        values = (q - (0 if fmt.affine else 8)).astype(np.float64)
    else:
        data, values = q.astype(np.int8), q.astype(np.float64)
    per = n // groups
    wf = values * np.repeat(scale, per, axis=1) + (0 if offset is None else np.repeat(offset, per, axis=1))
    dt = np.dtype(fmt.scale_dtype)
    w = QuantizedWeight(jnp.asarray(data), jnp.asarray(scale.astype(dt)),
                        None if offset is None else jnp.asarray(offset.astype(dt)))
    for rows in (5, 21):  # amx: lane passes; a tile and a tail
        x = rng.integers(-127, 128, (rows, n)).astype(np.float64)
        x.reshape(rows, n // 32, 32)[:, :, 0] = 127  # every block's max is 127 ...
        x *= 2.0 ** rng.integers(-3, 3, (rows, 1))  # ... times a power of two: its step, exactly
        y = np.asarray(_matmul(_path(path))(jnp.asarray(x.astype(np.float32)), w, fmt))
        np.testing.assert_array_equal(y, (x @ wf.T).astype(np.float32))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "name", k))
def test_every_path_every_row_count_gives_the_same_bits(kind):
    """Batch invariance on every path, and the lane paths' agreement (their integer lanes are exact on every
    instruction set, and the float work around them is the same code). amx sums whole blocks, by tile products
    from 16 inputs on and by lane passes below: the same integers, the same float work. 300 rows of 768 values span
    two of the lane kernel's input blocks and two of amx's passes."""
    paths = isa.available()
    if not paths:
        pytest.skip(f"no integer path on this CPU ({isa.describe()})")
    assert 300 * 768 > X_BLOCK_BYTES and 300 > TOKENS_PER_PASS
    w, fmt, _ = _case(kind, (98, 768))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((300, 768)).astype(np.float32))
    lanes = [path for path in paths if path != "amx"]
    for path in paths:
        together = np.asarray(_matmul(path)(x, w, fmt))
        for n in (1, 3, 15, 16, 17, 32, 129):
            np.testing.assert_array_equal(np.asarray(_matmul(path)(x[:n], w, fmt)), together[:n], err_msg=path)
        np.testing.assert_array_equal(np.asarray(_matmul(path)(x[5:6], w, fmt))[0], together[5], err_msg=path)
        if path in lanes:
            np.testing.assert_array_equal(together, np.asarray(_matmul(lanes[0])(x, w, fmt)), err_msg=path)


@pytest.mark.parametrize("rows", [1, 70, 300])
def test_the_kernel_quantizes_inputs_as_the_reference(rows):
    paths = isa.available()
    if not paths:
        pytest.skip(f"no integer path on this CPU ({isa.describe()})")
    w, fmt, _ = _case(KINDS[2], (8, 576))
    x = np.random.default_rng(rows).standard_normal((rows, 576)).astype(np.float32) * 3
    x[0, :32] = 0.0  # an all-zero block: step 0, values 0
    x[-1, 40] = 1e4  # a block dominated by one value
    data, scale, offset = w
    run = jax.jit(lambda x: cpu.int8_kernel(paths[0], x, data[None], scale[None], offset[None], jnp.int32(0))[1])
    got, want = run(jnp.asarray(x)), activations.quantize(jnp.asarray(x))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.all(np.asarray(got.q)[0, :32] == 0) and float(got.d[0, 0]) == 0.0


def test_path_choice_and_override(monkeypatch):
    monkeypatch.setenv(isa.ENV, "none")
    assert isa.best() is None and choose_kernels("auto", "auto", platform="cpu").int8_isa is None
    monkeypatch.setenv(isa.ENV, "avx7")
    with pytest.raises(ValueError, match="unknown integer dot-product"):
        isa.best()
    monkeypatch.delenv(isa.ENV)
    assert isa.best() == ([path for path in isa.available() if path != "amx"] or [None])[0]  # amx: when asked
    assert choose_kernels("auto", "auto", platform="cpu").int8_isa == isa.best()
    assert choose_kernels("auto", "reference", platform="cpu").int8_isa is None
    assert choose_kernels("auto", "auto", platform="tpu").int8_isa is None
    for path in isa.ISAS:
        if not isa.supported(path):
            monkeypatch.setenv(isa.ENV, path)
            with pytest.raises(ValueError, match="cannot run it"):
                isa.best()


@functools.cache
def _grouped(path):
    return jax.jit(functools.partial(cpu.grouped_matmul, isa=path), static_argnums=2)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: getattr(k, "name", k))
def test_the_grouped_kernel_gives_each_row_its_experts_plain_result(kind):
    """A mixture of experts' projection: rows in any order, each by its expert (some experts with none, one with
    several apart), one layer of a stack of [layers, experts, out, in] read in place. Each row's output is, bit for
    bit, the plain kernel's for that row and its expert's matrix (one arithmetic: batch invariant whatever else is
    routed), and close to the float64 product; the reference (dequantized experts) close to the float product."""
    paths = isa.available()
    if not paths:
        pytest.skip(f"no integer path on this CPU ({isa.describe()})")
    layers, experts, out, n = 2, 6, 40, 256  # 40 rows: two full 16-row chunks and a tail
    w, fmt, wf = _case(kind, (layers, experts, out, n))
    row_expert = np.array([3, 0, 3, 5, 2, 3, 0, 5, 3, 0, 3], np.int32)  # experts 1 and 4: no row
    x = np.random.default_rng(5).standard_normal((len(row_expert), n)).astype(np.float32)
    for layer in (0, 1):
        for path in paths:
            got = np.asarray(_grouped(path)(jnp.asarray(x), w, fmt, jnp.asarray(row_expert), jnp.int32(layer)))
            assert got.shape == (len(x), out)
            for r, e in enumerate(row_expert):
                one = jax.tree.map(lambda a, e=e, layer=layer: None if a is None else a[layer, e], w,
                                   is_leaf=lambda a: a is None)
                want = np.asarray(_matmul(path)(jnp.asarray(x[r:r + 1]), one, fmt))[0]
                np.testing.assert_array_equal(got[r], want, err_msg=f"{path} row {r}")
        xa = np.asarray(activations.dequantize(activations.quantize(jnp.asarray(x))), np.float64)
        wr = np.asarray(wf, np.float64)[layer, row_expert]  # [rows, out, in]: each row's expert
        exact = np.einsum("rn,ron->ro", xa, wr)
        assert np.all(np.abs(got - exact) <= 2e-6 * n ** 0.5 * np.einsum("rn,ron->ro", np.abs(xa), np.abs(wr)))
        reference = cpu.grouped_reference(jnp.asarray(x), w, fmt, jnp.asarray(row_expert), jnp.int32(layer))
        np.testing.assert_allclose(np.asarray(reference), np.einsum("rn,ron->ro", x, wr), rtol=1e-4, atol=1e-4)
