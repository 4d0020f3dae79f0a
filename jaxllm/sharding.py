"""Tensor-parallel sharding: logical axis names on parameters -> a 1-D device mesh axis ``tp``.

Heads, KV heads, the MLP hidden dim and (when it divides) the vocabulary are split across ``tp`` devices
(Megatron style: column-parallel q/k/v/gate/up, row-parallel o/down); everything else is replicated. XLA's
GSPMD inserts the all-reduces.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxllm.config import ConfigError, ModelConfig

TP_AXIS = "tp"


def make_mesh(tensor_parallel_size: int = 1, devices: list | None = None) -> Mesh:
    devices = devices if devices is not None else jax.devices()
    if tensor_parallel_size < 1 or tensor_parallel_size > len(devices):
        raise ConfigError(f"tensor_parallel_size={tensor_parallel_size} needs that many devices; "
                          f"{len(devices)} available ({jax.default_backend()})")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (TP_AXIS,), axis_types=(AxisType.Auto,))


def check_tensor_parallel(cfg: ModelConfig, tp: int) -> None:
    for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size)):
        if n % tp:
            raise ConfigError(f"tensor_parallel_size={tp} must divide {name}={n}")


def logical_rules(cfg: ModelConfig, tp: int) -> dict[str, str | None]:
    check_tensor_parallel(cfg, tp)
    return {
        "q_heads": TP_AXIS, "kv_heads": TP_AXIS, "mlp": TP_AXIS,
        "vocab": TP_AXIS if cfg.vocab_size % tp == 0 else None,
        "embed": None,
    }


def named_sharding(mesh: Mesh, rules: dict[str, str | None], axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(rules.get(a) if a else None for a in axes)))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[kv_heads, num_pages, page_size, head_dim]: each device holds its own KV heads."""
    return NamedSharding(mesh, PartitionSpec(TP_AXIS, None, None, None))


def shard_abstract(model, mesh: Mesh) -> None:
    """Gives an abstract model's parameters (ShapeDtypeStructs, e.g. ``rngs=None``) the shardings the rules
    give them on `mesh`: enough to lower or export a tensor-parallel step without weights."""
    from flax import nnx

    rules = logical_rules(model.config, mesh.shape[TP_AXIS])
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                           sharding=named_sharding(mesh, rules, var.get_metadata()["axes"])))
