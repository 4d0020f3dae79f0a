"""GGUF blocks repacked for the quantized kernels are bit-exact with gguf's own dequantization; conversions
between formats are lossless; int8 made from float stays close."""

import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from jaxllm.loading.gguf_quant import FORMATS, repack
from jaxllm.loading.quantize import HostQuantized, convert, dequantize, quantize_int8
from pallas_kernels.quantized_matmul.format import INT8
from tests.quant_blocks import QTYPES, random_blocks


@pytest.mark.parametrize("qtype", QTYPES, ids=lambda t: t.name)
def test_repack_is_bit_exact(qtype):
    shape = (24, 512)
    raw = random_blocks(qtype, shape)
    w = repack(raw, qtype, shape)
    fmt = FORMATS[qtype]
    assert w.data.shape == fmt.data_shape(*shape) and w.scale.shape == fmt.scale_shape(*shape)
    assert (w.offset is not None) == fmt.affine
    np.testing.assert_array_equal(dequantize(w, fmt), gguf_dequantize(raw, qtype))


@pytest.mark.parametrize("pair", [(QTYPES[i], QTYPES[j]) for i in range(6) for j in range(i + 1, 6)],
                         ids=lambda p: f"{p[0].name}+{p[1].name}")
def test_join_holds_both_losslessly(pair):
    shape = (8, 256)
    a, b = pair
    fa, fb = FORMATS[a], FORMATS[b]
    joined = fa.join(fb)
    assert joined == fb.join(fa)
    for qtype, fmt in ((a, fa), (b, fb)):
        raw = random_blocks(qtype, shape, seed=1)
        held = convert(HostQuantized(repack(raw, qtype, shape), fmt, shape), joined)
        np.testing.assert_array_equal(dequantize(held, joined), gguf_dequantize(raw, qtype))


def test_int8_per_channel():
    w = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    w[3] = 0
    q = quantize_int8(w)
    assert q.data.dtype == np.int8 and q.scale.shape == (16, 1) and q.offset is None
    back = dequantize(q, INT8)
    assert np.all(np.abs(back - w) <= q.scale / 2 + 1e-7)
    assert np.all(back[3] == 0)
