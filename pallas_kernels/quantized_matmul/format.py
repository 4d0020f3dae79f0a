"""How a quantized weight's arrays are laid out.

``W [out, in]`` is stored as (leading axes, e.g. a layer stack, may precede ``out`` in every array):
- ``data``: 8-bit: ``int8 [out, in]``; 4-bit: ``uint8 [out, in // 2]``, each group of 32 values in 16 bytes, the
  low nibbles holding values 0-15 and the high nibbles values 16-31 (GGUF's Q4_0/Q4_1 order: one byte load feeds
  two runs of 16 consecutive inputs);
- ``scale``: ``[out, in // group]`` float16 or float32;
- ``offset``: like ``scale``, affine formats only.
Value ``i`` of row ``r`` is ``q[r, i] * scale[r, i // group] + offset[r, i // group]``; symmetric 4-bit data
(no offset) is centred on 8: ``(q[r, i] - 8) * scale[r, i // group]`` (GGUF's Q4_0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import numpy as np

GROUP_4BIT = 32  # 4-bit data is packed per 32-value group


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    bits: int  # 4 or 8
    group: int  # input values per scale; 0: one scale per output row (per-channel)
    affine: bool  # an offset per group
    scale_dtype: str  # "float16" or "float32"
    name: str = dataclasses.field(default="", compare=False)  # where it came from (q4_1, int8, ...), for logs
    interleaved: bool = False  # the arrays interleaved by 16 rows (`interleave`), for the CPU int8 kernel

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise ValueError(f"quantized weights are 4- or 8-bit, not {self.bits}-bit")
        if self.bits == 4 and self.group != GROUP_4BIT:
            raise ValueError("4-bit weights are grouped by 32")
        if self.group < 0 or (self.group and (self.group < 16 or self.group & (self.group - 1))):
            raise ValueError(f"group must be 0 (per channel) or a power of two >= 16, not {self.group}")
        if self.scale_dtype not in ("float16", "float32"):
            raise ValueError(f"scale_dtype must be float16 or float32, not {self.scale_dtype!r}")
        if self.interleaved and self.group != 32:
            raise ValueError("only weights grouped by 32 are interleaved")

    def groups(self, in_features: int) -> int:
        if self.group and in_features % self.group:
            raise ValueError(f"{self.label}: {in_features} input features are not a whole number of "
                             f"{self.group}-value groups")
        return in_features // self.group if self.group else 1

    def data_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, in_features // 2 if self.bits == 4 else in_features)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, self.groups(in_features))

    @property
    def data_dtype(self):
        return np.dtype(np.uint8 if self.bits == 4 else np.int8)

    @property
    def label(self) -> str:
        return self.name or f"{self.bits}-bit {'affine' if self.affine else 'symmetric'}/{self.group or 'row'}"

    def bits_per_value(self, in_features: int) -> float:
        extra = (1 + self.affine) * np.dtype(self.scale_dtype).itemsize * 8 * self.groups(in_features)
        return self.bits + extra / in_features

    def join(self, other: QuantFormat | None) -> QuantFormat | None:
        """One format that holds both losslessly (None: float), for a parameter whose parts (fused q/k/v, a
        stack of layers) come in different formats: 8-bit, the finer group, affine if either is."""
        if self.interleaved or (other is not None and other.interleaved):
            raise ValueError("interleaved weights are not joined (interleave after fusing)")
        if other is None or other == self:
            return None if other is None else self
        if 0 in (self.group, other.group):
            return None  # per-channel beside grouped: no common grouping, keep float
        scale = "float16" if self.scale_dtype == other.scale_dtype == "float16" else "float32"
        return QuantFormat(8, math.gcd(self.group, other.group), self.affine or other.affine, scale,
                           name=f"{self.label}+{other.label}")


class QuantizedWeight(NamedTuple):
    """The arrays of one quantized weight (jax or numpy; `offset` None when symmetric)."""
    data: jax.Array | np.ndarray
    scale: jax.Array | np.ndarray
    offset: jax.Array | np.ndarray | None


INT8 = QuantFormat(8, 0, False, "float32", name="int8")
