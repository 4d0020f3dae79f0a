"""An adapter's weights in the model's table layout (`jaxllm.models.lora`): per LoRA-capable linear layer, its
parts' A matrices side by side along the rank axis (each padded to the table's rank with zeros) and their B
matrices block-diagonally, B's rows in the fused projection's own order: q/k/v grouped by KV head
(``[kv_heads, group + 2, head_dim]``, as `jaxllm.models.attention` fuses them), gate/up interleaved
(``[mlp, 2]``)."""

from __future__ import annotations

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.lora.adapter import LoRAAdapter
from jaxllm.models.lora import PARTS, TARGETS, linear_shape

_MODULE_OF = {(linear, part): module for module, (linear, part) in TARGETS.items()}


def _fused_rows(cfg: ModelConfig, linear: str, part: str | None) -> np.ndarray | None:
    """The fused layer's rows that hold `part`'s rows, in the part's order (None: the layer is not fused)."""
    if linear == "self_attn.qkv_proj":
        kvh, group, d = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        grid = np.arange(kvh * (group + 2) * d).reshape(kvh, group + 2, d)
        return {"q": grid[:, :group], "k": grid[:, group], "v": grid[:, group + 1]}[part].reshape(-1)
    if linear == "mlp.gate_up_proj":
        grid = np.arange(2 * cfg.intermediate_size).reshape(-1, 2)
        return grid[:, {"gate": 0, "up": 1}[part]]
    return None


def pack_layer(adapter: LoRAAdapter, cfg: ModelConfig, layer: int, rank: int) -> dict[str, tuple[np.ndarray,
                                                                                                 np.ndarray]]:
    """Layer `layer`'s tables for `adapter` at table rank `rank`: linear -> (a [parts * rank, in], b [out, parts *
    rank]) float32, zeros where the adapter has no weights."""
    out = {}
    for linear, parts in PARTS.items():
        n_out, n_in = linear_shape(cfg, linear)
        a = np.zeros((len(parts) * rank, n_in), np.float32)
        b = np.zeros((n_out, len(parts) * rank), np.float32)
        for i, part in enumerate(parts):
            pair = adapter.weights.get((layer, _MODULE_OF[(linear, part)]))
            if pair is None:
                continue
            pa, pb = pair  # [r, in], [out_part, r]
            r = pa.shape[0]
            a[i * rank:i * rank + r] = pa
            rows = _fused_rows(cfg, linear, part)
            if rows is None:
                b[:, i * rank:i * rank + r] = pb
            else:
                b[rows, i * rank:i * rank + r] = pb
        out[linear] = (a, b)
    return out
