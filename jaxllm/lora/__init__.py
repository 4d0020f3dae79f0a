"""LoRA adapters served over one base model (vLLM's multi-LoRA): `LoRARequest` names a request's adapter, `adapter`
reads PEFT's files, `layout` packs them into the model's slot tables (`jaxllm.models.lora`), `manager` keeps them
on the host and in the device's slots."""

from jaxllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
