"""Qwen3: RMSNorm on q and k per head."""

from jaxllm.models.family import FamilySpec

SPEC = FamilySpec("Qwen3ForCausalLM", gguf_arch="qwen3", qk_norm=True)
