"""Matmuls against weights kept quantized: ``x [T, in] @ dequantize(W)[out, in]^T``.

A quantized weight is three arrays (`format.QuantFormat` says how to read them): ``data`` (two 4-bit values per
byte, or int8), ``scale`` and, for affine formats, ``offset``, one of each per group of input values;
a value is ``q * scale + offset`` (``(q - 8) * scale`` for symmetric 4-bit). Two families cover every format
jaxllm serves losslessly: 4-bit, symmetric or affine per 32 (GGUF Q4_0; Q4_1, Q4_K) and 8-bit, symmetric or
affine (GGUF Q8_0, Q6_K, per-channel int8; Q5_K).

`reference.matmul` dequantizes in jnp and runs XLA's dot (what GPU and TPU run: XLA fuses the conversion into
the dot's operand); `cpu.matmul` is the CPU kernel (numba behind an XLA custom call) for decode-shaped steps.
"""

from pallas_kernels.quantized_matmul.format import QuantFormat, QuantizedWeight
from pallas_kernels.quantized_matmul.reference import dequantize, matmul

__all__ = ["QuantFormat", "QuantizedWeight", "dequantize", "matmul"]
