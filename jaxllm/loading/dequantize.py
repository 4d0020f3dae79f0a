"""GGUF block quantizations to float32, vectorized over whole tensors.

`gguf.quants.dequantize` is the reference (and handles every type); it splits tensors into row groups and makes
several full-size temporaries (README: `benchmarks/load.py`). The common types here are decoded in
chunks of blocks that stay in the CPU caches. Other types go to `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxllm.dtypes import E2M1_VALUES

CHUNK_BLOCKS = 8192  # blocks decoded at a time: 256 K values, 1 MB of float32 output


def _scale(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of every block, as float32 [n, 1]."""
    return np.ascontiguousarray(blocks[:, at:at + 2]).view(np.float16).astype(np.float32)


def _q8_0(blocks: np.ndarray, out: np.ndarray) -> None:  # d (f16), 32 x int8
    np.multiply(blocks[:, 2:].view(np.int8), _scale(blocks, 0), out=out)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values: the low nibbles are values 0-15, the high ones 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q4_0(blocks: np.ndarray, out: np.ndarray) -> None:  # d (f16), 16 bytes of nibbles; (q - 8) * d
    q = _nibbles(blocks[:, 2:]).view(np.int8)
    np.subtract(q, np.int8(8), out=q)
    np.multiply(q, _scale(blocks, 0), out=out)


def _q4_1(blocks: np.ndarray, out: np.ndarray) -> None:  # d, m (f16), 16 bytes of nibbles; q * d + m
    np.multiply(_nibbles(blocks[:, 4:]), _scale(blocks, 0), out=out)
    out += _scale(blocks, 2)


def _mxfp4(blocks: np.ndarray, out: np.ndarray) -> None:  # e (E8M0: 2^(e - 127)), 16 bytes of E2M1 nibbles
    np.take(E2M1_VALUES, _nibbles(blocks[:, 1:]), out=out)
    np.ldexp(out, blocks[:, :1].astype(np.int32) - 127, out=out)


_DECODERS = {GGMLQuantizationType.Q8_0: _q8_0, GGMLQuantizationType.Q4_0: _q4_0, GGMLQuantizationType.Q4_1: _q4_1,
             GGMLQuantizationType.MXFP4: _mxfp4}


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """raw: the tensor's bytes (uint8); shape: numpy order. -> float32 array of `shape`."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    decode = _DECODERS.get(qtype)
    if decode is None:
        from gguf.quants import dequantize as reference

        return reference(raw.reshape(*shape[:-1], shape[-1] // block * type_size), qtype).reshape(shape)
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block), np.float32)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        decode(blocks[start:start + CHUNK_BLOCKS], out[start:start + CHUNK_BLOCKS])
    return out.reshape(shape)
