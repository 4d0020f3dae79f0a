"""GGUF quantized tensors repacked, not dequantized: the integer values, scales and offsets of each block laid
out as `pallas_kernels.quantized_matmul` reads them (``q * scale + offset``), bit-exact with
`gguf.quants.dequantize`.

- Q8_0 (int8, float16 scale per 32), Q4_0 (4-bit ``(q - 8) d``) and Q4_1 (4-bit, float16 scale and min per 32)
  keep their bytes: only the block headers move into the scale/offset arrays.
- Q4_K: each 32-value sub-block is affine (``d * sc`` and ``-dmin * m``: products of a float16 and a 6-bit
  integer, exact in float32), so it is Q4_1 with float32 scales; its nibbles are reordered to Q4_1's.
- Q5_K: affine per 32 with 5-bit values: 8-bit data. Q6_K: symmetric per 16 (``d * scale``), 6-bit values:
  8-bit data.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K

from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight

T = GGMLQuantizationType
FORMATS: dict[GGMLQuantizationType, QuantFormat] = {
    T.Q8_0: QuantFormat(8, 32, False, "float16", name="q8_0"),
    T.Q4_0: QuantFormat(4, 32, False, "float16", name="q4_0"),
    T.Q4_1: QuantFormat(4, 32, True, "float16", name="q4_1"),
    T.Q4_K: QuantFormat(4, 32, True, "float32", name="q4_k"),
    T.Q5_K: QuantFormat(8, 32, True, "float32", name="q5_k"),
    T.Q6_K: QuantFormat(8, 16, False, "float32", name="q6_k"),
}


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block: [n]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16)[:, 0]


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[..., 32] values 0-15 -> [..., 16] bytes: low nibble value j, high nibble value j + 16."""
    return (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K headers -> float32 scale and offset per 32-value sub-block, [n, 8]."""
    d, dmin = _f16(blocks, 0).astype(np.float32), _f16(blocks, 2).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    return d[:, None] * sc.astype(np.float32), -(dmin[:, None] * m.astype(np.float32))


def _low_high(qs: np.ndarray, chunk: int) -> np.ndarray:
    """k-quant nibbles [n, bytes] -> values [n, 2 * bytes / 32, 32]: each run of `chunk` bytes holds a
    sub-block in its low nibbles and the next in its high nibbles."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, chunk) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(n, -1, 32)


def repack(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> QuantizedWeight:
    """raw: the tensor's bytes (uint8); shape: numpy order [..., in]. -> arrays of FORMATS[qtype], leading
    dimensions as `shape`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    lead, n_in = tuple(shape[:-1]), shape[-1]
    blocks = np.asarray(raw).reshape(-1, type_size)
    n = blocks.shape[0]
    offset = None
    if qtype == T.Q8_0:
        data, scale = blocks[:, 2:].view(np.int8), _f16(blocks, 0)
    elif qtype == T.Q4_0:
        data, scale = blocks[:, 2:], _f16(blocks, 0)
    elif qtype == T.Q4_1:
        data, scale, offset = blocks[:, 4:], _f16(blocks, 0), _f16(blocks, 2)
    elif qtype == T.Q4_K:
        scale, offset = _k_scales(blocks)
        data = _pack_nibbles(_low_high(blocks[:, 16:], 32))  # [n, 8, 16]
    elif qtype == T.Q5_K:
        scale, offset = _k_scales(blocks)
        high = (blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        data = (_low_high(blocks[:, 48:], 32) | (high << 4)).view(np.int8)  # [n, 8, 32], 0..31
    elif qtype == T.Q6_K:
        low = _low_high(blocks[:, :128], 64)  # [n, 8, 32]
        high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
        data = ((low | (high.reshape(n, 8, 32) << 4)).view(np.int8) - np.int8(32))
        scale = _f16(blocks, 208).astype(np.float32)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
    else:
        raise ValueError(f"GGUF type {qtype.name} is not kept quantized")
    fmt = FORMATS[qtype]
    groups = fmt.groups(n_in)
    data = np.ascontiguousarray(data).reshape(*lead, fmt.data_shape(1, n_in)[1])
    scale = np.ascontiguousarray(scale).reshape(*lead, groups).astype(fmt.scale_dtype)
    offset = None if offset is None else np.ascontiguousarray(offset).reshape(*lead, groups).astype(fmt.scale_dtype)
    assert n * block == int(np.prod(shape))
    return QuantizedWeight(data, scale, offset)
