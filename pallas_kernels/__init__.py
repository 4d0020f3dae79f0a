"""Attention kernels for the paged KV cache: a jnp reference (the CPU fast path) and Pallas kernels for TPU
and GPU, all behind one signature."""
