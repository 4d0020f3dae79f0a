"""vLLM's `LoRARequest`: which adapter a request runs with."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # unique per adapter, > 0: the engine's key for it (two names of one id are one adapter)
    lora_path: str  # a PEFT adapter folder
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def cache_key(self) -> str:
        """What keeps its prefix-cache pages apart from every other adapter's and the base model's."""
        return f"lora:{self.lora_int_id}:{self.lora_name}:{self.lora_path}"
