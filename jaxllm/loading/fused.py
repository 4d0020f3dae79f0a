"""Checkpoint tensors the model keeps fused: q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj; and checkpoint
tensors fused in another order (Phi-3's qkv_proj: all q rows, then k, then v), split into those parts first.

The row orders are those the model documents (`jaxllm.models.attention.Attention`, `jaxllm.models.llama.MLP`):
qkv rows grouped by KV head ``[kv_heads, group + 2, head_dim]``, gate/up rows interleaved ``[mlp, 2]``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

import numpy as np

from jaxllm.config import ModelConfig

NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}  # the parts of each (which module is which: `FamilySpec.fused`)


def part_shapes(fused: str, cfg: ModelConfig, shape: tuple[int, ...], axis: int = 0) -> list[tuple[int, ...]]:
    """Each part's shape as a checkpoint stores it, of a fused parameter of `shape` whose rows are `axis` ([out, in]
    for weights, [out] for biases, [experts, out, in] for all of a layer's experts; gate/up: two halves, whatever
    the MLP's width: a dense MLP's, an expert's, a shared expert's)."""
    if fused == "qkv_proj":
        tail = shape[1:]
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return [(q, *tail), (kv, *tail), (kv, *tail)]
    return [(*shape[:axis], shape[axis] // 2, *shape[axis + 1:])] * 2


def fuse(fused: str, parts: list[np.ndarray], cfg: ModelConfig, axis: int = 0) -> np.ndarray:
    """parts in PARTS order, shaped as `part_shapes` says (or the same share of each: one host's heads or MLP
    rows) -> the fused array, its rows along `axis` (gate/up of all of a layer's experts: 1)."""
    if fused != "qkv_proj":  # [..., mlp, 2, ...] -> [..., 2 * mlp, ...]
        shape = parts[0].shape
        return np.stack(parts, axis=axis + 1).reshape(*shape[:axis], 2 * shape[axis], *shape[axis + 1:])
    tail = parts[0].shape[1:]
    q, k, v = parts
    d = cfg.head_dim
    kvh = k.shape[0] // d
    grouped = np.concatenate([q.reshape(kvh, -1, d, *tail), k.reshape(kvh, 1, d, *tail),
                              v.reshape(kvh, 1, d, *tail)], axis=1)  # [kv_heads, group + 2, head_dim, ...]
    return grouped.reshape(-1, *tail)


def split_rows(parts: tuple[str, ...], cfg: ModelConfig) -> list[int]:
    """The rows of each part, in order, of a checkpoint tensor that stacks `parts` (q_proj, k_proj, v_proj;
    gate_proj, up_proj)."""
    rows = {"q_proj": cfg.num_heads * cfg.head_dim, "k_proj": cfg.num_kv_heads * cfg.head_dim,
            "v_proj": cfg.num_kv_heads * cfg.head_dim, "gate_proj": cfg.intermediate_size,
            "up_proj": cfg.intermediate_size}
    return [rows[p] for p in parts]


class _Shared:
    """One checkpoint tensor read once for several parts (on the loader threads) and dropped after the last."""

    def __init__(self, load: Callable[[], np.ndarray], readers: int):
        self.load, self.left, self.value, self.lock = load, readers, None, threading.Lock()

    def rows(self, start: int, stop: int, total: int):
        """Rows [start, stop) of the tensor: a float array, or a GGUF tensor kept quantized (`HostQuantized`)."""
        with self.lock:
            if self.value is None:
                value = self.load()
                self.value = value if hasattr(value, "map_rows") else np.asarray(value)
                if self.value.shape[0] != total:  # the config and the checkpoint disagree: the loader says so
                    self.left, value, self.value = 0, self.value, None
                    return value
            if hasattr(self.value, "map_rows"):
                part = self.value.map_rows(lambda a: np.array(a[start:stop]))
            else:
                part = np.array(self.value[start:stop])
            self.left -= 1
            if self.left == 0:
                self.value = None
            return part


def split(tensors: Iterable[tuple[str, Callable, str]], stacked: Mapping[str, tuple[str, ...]], cfg: ModelConfig
          ) -> Iterator[tuple[str, Callable, str]]:
    """Checkpoint tensors whose module stacks several of the model's parts (`FamilySpec.split`: module -> parts,
    in row order) -> one tensor per part, named as that part's module; the others as they are."""
    for name, load, source in tensors:
        pieces = name.split(".")
        module = pieces[-2] if len(pieces) > 1 else ""
        if module not in stacked:
            yield name, load, source
            continue
        rows = split_rows(stacked[module], cfg)
        shared, start = _Shared(load, len(rows)), 0
        for part, n in zip(stacked[module], rows, strict=True):
            read = functools.partial(shared.rows, start, start + n, sum(rows))
            yield ".".join([*pieces[:-2], part, pieces[-1]]), read, source
            start += n
