"""Random GGUF-quantized tensors for tests: random block bytes with finite float16 headers (random bytes are
valid blocks of every type once the float16 fields hold finite numbers)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
# byte offsets of each block's float16 fields
F16_FIELDS = {T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
QTYPES = tuple(F16_FIELDS)


def random_blocks(qtype: GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """The raw bytes (uint8 [..., in // block * type_size]) of a random tensor of numpy shape `shape`."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        raw[:, at:at + 2] = (rng.standard_normal(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw.reshape(*shape[:-1], -1)
