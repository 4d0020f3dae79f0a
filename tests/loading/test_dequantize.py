"""The vectorized GGUF dequantization against gguf's reference, bit for bit."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference
from gguf.quants import quantize

from jaxllm.loading import dequantize as module
from jaxllm.loading.dequantize import dequantize


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1])
def test_matches_the_reference(qtype, monkeypatch):
    monkeypatch.setattr(module, "CHUNK_BLOCKS", 5)  # several chunks, the last one partial
    x = np.random.default_rng(0).standard_normal((7, 96)).astype(np.float32) * 3
    raw = quantize(x, qtype)
    got = dequantize(raw.reshape(-1).view(np.uint8), qtype, x.shape)
    assert got.dtype == np.float32 and got.shape == x.shape
    np.testing.assert_array_equal(got, reference(raw, qtype))
