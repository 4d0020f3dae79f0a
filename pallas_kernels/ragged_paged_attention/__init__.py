"""Ragged paged attention: one flat batch of query tokens from many sequences (decodes, prefill chunks,
prefix-cached prompts) attending to their own pages of the KV cache.

All implementations share the signature of `reference.ragged_paged_attention`."""

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention

__all__ = ["ragged_paged_attention"]
