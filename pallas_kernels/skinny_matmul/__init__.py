"""Matmuls with few rows, ``x [T, in] @ W[out, in]^T`` for small T (single-sequence decode, the LM head of a
decode step): memory-bound, so what matters is streaming the weights at the memory bandwidth.

`reference.matmul` is XLA's dot; `cpu.matmul` is the CPU kernel (numba behind an XLA custom call)."""

from pallas_kernels.skinny_matmul.reference import matmul

__all__ = ["matmul"]
