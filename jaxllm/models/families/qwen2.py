"""Qwen2 / Qwen2.5: q/k/v biases by default (o_proj without one)."""

from jaxllm.models.family import FamilySpec

SPEC = FamilySpec("Qwen2ForCausalLM", gguf_arch="qwen2", attention_bias_default=True,
                  o_bias_follows_attention_bias=False)
