"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's decoder with q/k/v stacked in one checkpoint tensor (all q rows, then
k, then v) and gate/up in another, a sliding window without `use_sliding_window`, and a partial rotary factor
(`RopeConfig.partial_rotary_factor`). LongRoPE configs (`rope_scaling` type "longrope", the 128k variants) load
from HF folders (`jaxllm.models.rope`); a GGUF file's `rope_factors_*` tensors are refused. llama.cpp's GGUF files
keep the same stacked tensors (`attn_qkv`, `ffn_up` holding gate and up) with q/k rows in Hugging Face's order."""

from jaxllm.models.family import LLAMA_GGUF_LAYER_NAMES, FamilySpec

SPEC = FamilySpec("Phi3ForCausalLM", gguf_arch="phi3", sliding_window_default=True,
                  gguf_layer_names={**LLAMA_GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj",
                                    "ffn_up": "mlp.gate_up_proj"},
                  split={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
