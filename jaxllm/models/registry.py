"""Architectures jaxllm runs, keyed by the Hugging Face `architectures` name.

All of them are the same decoder (`jaxllm.models.llama.LlamaForCausalLM`); a spec records only how each
family's config differs from Llama's.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ArchitectureSpec:
    gguf_arch: str  # `general.architecture` in GGUF files
    attention_bias_default: bool = False
    o_bias_follows_attention_bias: bool = True
    qk_norm: bool = False
    tie_default: bool = False
    sliding_window_default: bool = False  # whether `sliding_window` applies without `use_sliding_window`
    permuted_qk_in_gguf: bool = False  # llama.cpp reorders q/k rows for interleaved RoPE


ARCHITECTURES: dict[str, ArchitectureSpec] = {
    "LlamaForCausalLM": ArchitectureSpec(gguf_arch="llama", permuted_qk_in_gguf=True),
    "MistralForCausalLM": ArchitectureSpec(gguf_arch="llama", sliding_window_default=True,
                                           permuted_qk_in_gguf=True),
    "Qwen2ForCausalLM": ArchitectureSpec(gguf_arch="qwen2", attention_bias_default=True,
                                         o_bias_follows_attention_bias=False),
    "Qwen3ForCausalLM": ArchitectureSpec(gguf_arch="qwen3", qk_norm=True),
}

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


class UnsupportedArchitectureError(ValueError):
    pass


def architecture_spec(name: str) -> ArchitectureSpec:
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {name!r}; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
