"""Checkpoint tensors the model keeps fused: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj.

The row orders are those the model documents (`jaxllm.models.attention.Attention`, `jaxllm.models.llama.MLP`):
qkv rows grouped by KV head ``[kv_heads, group + 2, head_dim]``, gate/up rows interleaved ``[mlp, 2]``.
"""

from __future__ import annotations

import numpy as np

from jaxllm.config import ModelConfig

NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}  # the parts of each (which module is which: `FamilySpec.fused`)


def part_shapes(fused: str, cfg: ModelConfig, tail: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each part's shape as a checkpoint stores it; tail is (in_features,) for weights, () for biases."""
    if fused == "qkv_proj":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(q, *tail), (kv, *tail), (kv, *tail)]
    return [(cfg.intermediate_size, *tail)] * 2


def fuse(fused: str, parts: list[np.ndarray], cfg: ModelConfig) -> np.ndarray:
    """parts in PARTS order, shaped as `part_shapes` says (or the same share of each: one host's heads or MLP
    rows) -> the fused [out, ...] array."""
    tail = parts[0].shape[1:]
    if fused == "qkv_proj":
        q, k, v = parts
        d = cfg.head_dim
        kvh = k.shape[0] // d
        grouped = np.concatenate([q.reshape(kvh, -1, d, *tail), k.reshape(kvh, 1, d, *tail),
                                  v.reshape(kvh, 1, d, *tail)], axis=1)  # [kv_heads, group + 2, head_dim, ...]
        return grouped.reshape(-1, *tail)
    return np.stack(parts, axis=1).reshape(-1, *tail)  # [mlp, 2, ...] -> [2 * mlp, ...]
