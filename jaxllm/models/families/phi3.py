"""Phi-3 (and Phi-3.5 / Phi-4-mini): Llama's decoder with q/k/v stacked in one checkpoint tensor (all q rows, then
k, then v) and gate/up in another, a sliding window without `use_sliding_window`, and a partial rotary factor
(`RopeConfig.partial_rotary_factor`). LongRoPE configs (`rope_scaling` type "longrope", the 128k variants) are
refused by the rope config; GGUF files of the family are not read yet."""

from jaxllm.models.family import FamilySpec

SPEC = FamilySpec("Phi3ForCausalLM", sliding_window_default=True,
                  split={"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")})
