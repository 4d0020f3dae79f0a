"""What an adapter is checked against: the base's layer count, the shape of every module it may target, and the
rank limit. An engine derives it from its model; an engine core sends it to its API servers at the handshake, so
that an adapter named by a server's configuration or loaded at run time is read and refused there, with the
same messages, before any request reaches the core."""

from __future__ import annotations

import msgspec

from jaxllm.config import ModelConfig
from jaxllm.models.lora import TARGETS, module_shape


class LoRASpec(msgspec.Struct, frozen=True, kw_only=True):
    max_rank: int
    num_layers: int
    shapes: dict[str, tuple[int, int]]  # PEFT module name -> (out, in), only the modules this model's layers take

    @classmethod
    def of(cls, cfg: ModelConfig, max_rank: int, linears: set[str]) -> LoRASpec:
        """linears: the model's LoRA-capable layers (`LoRATables.linears`)."""
        return cls(max_rank=max_rank, num_layers=cfg.num_layers,
                   shapes={m: module_shape(cfg, m) for m, (linear, _) in TARGETS.items() if linear in linears})
