"""Tensor-parallel sharding: logical axis names on parameters -> a device mesh axis ``tp`` (and ``ep`` for a
mixture of experts' experts, with expert parallelism).

Heads, KV heads, the MLP hidden dim and (when it divides) the vocabulary are split across ``tp`` devices
(Megatron style: column-parallel q/k/v/gate/up, row-parallel o/down); everything else is replicated. XLA's
GSPMD inserts the all-reduces.

A mixture of experts' expert weights ``[experts, out, in]`` are placed one of two ways:
- by default each expert's rows split over ``tp`` as a dense MLP's are ("expert_mlp" as "mlp"), and with
  ``expert_parallel_size`` > 1 the experts over a separate ``ep`` axis (the mesh ``ep`` x ``tp``, attention
  the same on every ``ep`` row);
- with ``experts_over_tp`` (vLLM's ``--enable-expert-parallel``) whole experts split over the ``tp`` devices
  themselves (over ``ep`` x ``tp`` where there is an ``ep`` axis): each device holds its share of the experts,
  each expert whole, while attention stays split over ``tp`` by heads.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxllm.config import ConfigError, ModelConfig

TP_AXIS = "tp"
EP_AXIS = "ep"


def make_mesh(tensor_parallel_size: int = 1, devices: list | None = None, expert_parallel_size: int = 1) -> Mesh:
    """A 1-D ``tp`` mesh; with expert parallelism, ``ep`` x ``tp``: the experts split over ``ep`` (each expert's
    rows over ``tp`` too), everything else as on one ``tp`` group, the same on every ``ep`` row."""
    devices = devices if devices is not None else jax.devices()
    tp, ep = tensor_parallel_size, expert_parallel_size
    if tp < 1 or ep < 1 or tp * ep > len(devices):
        raise ConfigError(f"tensor_parallel_size={tp} x expert_parallel_size={ep} needs that many devices; "
                          f"{len(devices)} available ({jax.default_backend()})")
    if ep == 1:
        return Mesh(np.asarray(devices[:tp]), (TP_AXIS,), axis_types=(AxisType.Auto,))
    return Mesh(np.asarray(devices[:tp * ep]).reshape(ep, tp), (EP_AXIS, TP_AXIS),
                axis_types=(AxisType.Auto, AxisType.Auto))


def check_tensor_parallel(cfg: ModelConfig, tp: int, ep: int = 1, experts_over_tp: bool = False) -> None:
    expert_rows = 0 if experts_over_tp else cfg.moe_intermediate_size  # (whole experts: any width)
    for name, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                    ("intermediate_size", cfg.intermediate_size), ("moe_intermediate_size", expert_rows),
                    ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if n % tp:
            raise ConfigError(f"tensor_parallel_size={tp} must divide {name}={n}")
    if ep > 1 and (not cfg.num_experts or cfg.num_experts % ep):
        raise ConfigError(f"expert_parallel_size={ep} must divide the number of experts ({cfg.num_experts})"
                          if cfg.num_experts else f"expert_parallel_size={ep} needs a mixture-of-experts model")
    if experts_over_tp and (not cfg.num_experts or cfg.num_experts % (tp * ep)):
        raise ConfigError(f"enable_expert_parallel splits the experts over {tp * ep} devices, which must divide the "
                          f"number of experts ({cfg.num_experts})" if cfg.num_experts else
                          "enable_expert_parallel needs a mixture-of-experts model")


Rules = dict[str, str | tuple[str, ...] | None]


def logical_rules(cfg: ModelConfig, tp: int, ep: int = 1, experts_over_tp: bool = False) -> Rules:
    """Each logical axis name's mesh axis (or axes); experts_over_tp: whole experts over the ``tp`` devices (and
    ``ep``'s), see the module's docstring."""
    check_tensor_parallel(cfg, tp, ep, experts_over_tp)
    if experts_over_tp:
        experts, expert_rows = ((EP_AXIS, TP_AXIS) if ep > 1 else TP_AXIS), None
    else:
        experts, expert_rows = (EP_AXIS if ep > 1 else None), TP_AXIS
    return {
        "q_heads": TP_AXIS, "kv_heads": TP_AXIS, "mlp": TP_AXIS,
        "vocab": TP_AXIS if cfg.vocab_size % tp == 0 else None,
        "embed": None,
        "expert": experts, "expert_mlp": expert_rows,
    }


def mesh_rules(cfg: ModelConfig, mesh: Mesh, experts_over_tp: bool = False) -> Rules:
    """`logical_rules` for `mesh`'s tensor- and expert-parallel sizes."""
    return logical_rules(cfg, mesh.shape[TP_AXIS], dict(mesh.shape).get(EP_AXIS, 1), experts_over_tp)


def named_sharding(mesh: Mesh, rules: Rules, axes: tuple[str | None, ...]) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(rules.get(a) if a else None for a in axes)))


def kv_cache_sharding(mesh: Mesh) -> NamedSharding:
    """[kv_heads, num_pages, page_size, head_dim]: each device holds its own KV heads."""
    return NamedSharding(mesh, PartitionSpec(TP_AXIS, None, None, None))


def shard_abstract(model, mesh: Mesh, experts_over_tp: bool = False) -> None:
    """Gives an abstract model's parameters (ShapeDtypeStructs, e.g. ``rngs=None``) the shardings the rules
    give them on `mesh`: enough to lower or export a tensor-parallel step without weights."""
    from flax import nnx

    rules = mesh_rules(model.config, mesh, experts_over_tp)
    for _, var in nnx.to_flat_state(nnx.state(model)):
        value = var.get_value()
        var.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype,
                                           sharding=named_sharding(mesh, rules, var.get_metadata()["axes"])))
