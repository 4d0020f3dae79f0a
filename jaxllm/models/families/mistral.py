"""Mistral: Llama with a sliding window on every layer (without `use_sliding_window`); its GGUF files share
Llama's architecture name."""

from jaxllm.models.family import FamilySpec

SPEC = FamilySpec("MistralForCausalLM", gguf_arch="llama", sliding_window_default=True, permuted_qk_in_gguf=True)
