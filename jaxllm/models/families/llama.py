"""Llama 2/3 (and SmolLM): the reference shape every other decoder family is described against."""

from jaxllm.models.family import FamilySpec

SPEC = FamilySpec("LlamaForCausalLM", gguf_arch="llama", permuted_qk_in_gguf=True)
