"""Gemma 3 (text; `Gemma3ForCausalLM`): Gemma 2's decoder with q/k norms, five windowed layers to one global
(`layer_types`), a RoPE of its own for the windowed layers (`rope_parameters` per layer type: the global layers'
may scale linearly, the windowed ones' base is 10k) and no soft-capping (transformers' Gemma 3 ignores
`attn_logit_softcapping`; a config's `final_logit_softcapping` still applies).

Its GGUF files (llama.cpp's "gemma3") hold the global layers' RoPE in `rope.*` and the windowed layers' base in
`rope.freq_base_swa` (default 10k); a file without `attention.sliding_window` has no windowed layers."""

from __future__ import annotations

from typing import Any

from jaxllm.config import ModelConfig, RopeConfig
from jaxllm.models.families.gemma2 import GEMMA_GGUF_LAYER_NAMES, gemma_config, gemma_gguf_config
from jaxllm.models.family import FamilySpec


def read_config(hf: dict[str, Any], spec: FamilySpec) -> ModelConfig:
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers v5: one set per layer type
        global_rope = RopeConfig.from_hf({"rope_parameters": params.get("full_attention") or {}})
        local_rope = RopeConfig.from_hf({"rope_parameters": params.get("sliding_attention") or {}})
    else:  # earlier configs: rope_theta / rope_scaling for the global layers, rope_local_base_freq
        global_rope = RopeConfig.from_hf({"rope_theta": 1_000_000.0, **hf})
        local_rope = RopeConfig(theta=float(hf.get("rope_local_base_freq", 10_000.0)))
    return gemma_config(hf, spec, pattern=6, qk_norm=True, rope=global_rope, local_rope=local_rope,
                        final_soft_cap=hf.get("final_logit_softcapping"))


def read_gguf(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    out = gemma_gguf_config(meta, arch, fields, pattern=6, big_layers=62)
    out["qk_norm"] = True
    if any(out["layer_windows"]):
        out["local_rope"] = RopeConfig(theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0)))
    else:
        out["layer_windows"] = None
    return out


SPEC = FamilySpec("Gemma3ForCausalLM", gguf_arch="gemma3", tie_default=True, qk_norm=True, config_reader=read_config,
                  gguf_config_reader=read_gguf, gguf_layer_names=GEMMA_GGUF_LAYER_NAMES)
