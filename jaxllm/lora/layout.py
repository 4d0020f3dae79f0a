"""An adapter's weights in the model's table layout (`jaxllm.models.lora`): per LoRA-capable linear layer, its
parts' A matrices side by side along the rank axis (each padded to the table's rank with zeros) and their B
rows, transposed, in the fused projection's own row order (`jaxllm.models.lora.row_parts`: q/k/v grouped by KV
head, gate/up interleaved), padded to the table's rank."""

from __future__ import annotations

import numpy as np

from jaxllm.config import ModelConfig
from jaxllm.lora.adapter import LoRAAdapter
from jaxllm.models.lora import PARTS, TARGETS, fused_layout, linear_shape, row_parts

_MODULE_OF = {(linear, part): module for module, (linear, part) in TARGETS.items()}


def _fused_rows(cfg: ModelConfig, linear: str, index: int) -> np.ndarray | None:
    """The fused layer's rows that hold its part `index`'s rows, in the part's order (None: the layer is not
    fused)."""
    parts = row_parts(fused_layout(cfg, linear))
    return None if parts is None else np.flatnonzero(parts == index)


def pack_layer(adapter: LoRAAdapter, cfg: ModelConfig, layer: int, rank: int) -> dict[str, tuple[np.ndarray,
                                                                                                 np.ndarray]]:
    """Layer `layer`'s tables for `adapter` at table rank `rank`: linear -> (a [parts * rank, in], b [rank, out])
    float32, zeros where the adapter has no weights."""
    out = {}
    for linear, parts in PARTS.items():
        n_out, n_in = linear_shape(cfg, linear)
        a = np.zeros((len(parts) * rank, n_in), np.float32)
        b = np.zeros((rank, n_out), np.float32)
        for i, part in enumerate(parts):
            pair = adapter.weights.get((layer, _MODULE_OF[(linear, part)]))
            if pair is None:
                continue
            pa, pb = pair  # [r, in], [out_part, r]
            r = pa.shape[0]
            a[i * rank:i * rank + r] = pa
            rows = _fused_rows(cfg, linear, i)
            if rows is None:
                b[:r] = pb.T
            else:
                b[:r, rows] = pb.T
        out[linear] = (a, b)
    return out
