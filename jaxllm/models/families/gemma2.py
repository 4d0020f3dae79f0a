"""Gemma 2: Llama's decoder with Gemma's norms ((1 + w), in float32; a norm on the attention's and the MLP's outputs
too), embeddings scaled by sqrt(hidden_size), attention scaled by `query_pre_attn_scalar`, attention scores and
final logits soft-capped, layers alternating between a sliding window and the whole context, a GeGLU (tanh) MLP
and tied embeddings.

Its GGUF files (llama.cpp's "gemma2") store the norms as 1 + w, name the sandwich norms `post_attention_norm`,
`ffn_norm` (before the MLP) and `post_ffw_norm`, and carry no `query_pre_attn_scalar`: llama.cpp scales by
head_dim ** -0.5, or (hidden / heads) ** -0.5 for the 27B model, and reads what `gemma_gguf_config` reads."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxllm.config import ConfigError, ModelConfig, RopeConfig
from jaxllm.models.family import LLAMA_GGUF_LAYER_NAMES, FamilySpec, llama_config

GEMMA_GGUF_LAYER_NAMES = {**LLAMA_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


def layer_windows(hf: dict[str, Any], pattern: int) -> tuple[int, ...]:
    """Each layer's window (0: the whole context) from `layer_types`, or from the older `sliding_window_pattern`
    (every pattern-th layer global, the others windowed), as transformers reads them."""
    layers = int(hf["num_hidden_layers"])
    window = hf.get("sliding_window", 4096)
    kinds = hf.get("layer_types") or [
        "full_attention" if (i + 1) % int(hf.get("sliding_window_pattern") or pattern) == 0 else "sliding_attention"
        for i in range(layers)]
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ConfigError(f"layer_types must name each of the {layers} layers 'sliding_attention' or "
                          f"'full_attention', got {kinds}")
    if window is None and "sliding_attention" in kinds:
        raise ConfigError("sliding_attention layers need a sliding_window")
    return tuple(int(window) if kind == "sliding_attention" else 0 for kind in kinds)


def gemma_config(hf: dict[str, Any], spec: FamilySpec, *, pattern: int, **overrides) -> ModelConfig:
    """A Gemma config.json -> ModelConfig (`pattern`: the family's windowed-layer pattern where the config names
    none; `overrides`: the family's own fields)."""
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention=True (an embedding model's) is not supported")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    hf = {**hf, "hidden_act": act, "rms_norm_eps": hf.get("rms_norm_eps", 1e-6)}
    scalar = hf.get("query_pre_attn_scalar", 256)
    return llama_config(
        hf, spec, **{"sliding_window": None, "layer_windows": layer_windows(hf, pattern), "rms_norm_offset": 1.0,
                     "sandwich_norms": True, "embed_scale": True, "attn_scale": float(scalar) ** -0.5, **overrides})


def read_config(hf: dict[str, Any], spec: FamilySpec) -> ModelConfig:
    return gemma_config(hf, spec, pattern=2, attn_soft_cap=hf.get("attn_logit_softcapping", 50.0),
                        final_soft_cap=hf.get("final_logit_softcapping", 30.0))


def gemma_gguf_config(meta: dict[str, Any], arch: str, fields: dict[str, Any], *, pattern: int,
                      big_layers: int) -> dict[str, Any]:
    """What a gemma2 / gemma3 GGUF file's metadata adds to the fields every family reads, as llama.cpp reads
    them: the windowed layers (`attention.sliding_window_pattern`, an int or one flag per layer), the final soft cap
    and the attention scale (`big_layers`: the layer count of the model scaled by hidden / heads); each family
    adds its own (Gemma 2's attention soft cap, the windowed layers' RoPE base)."""
    layers, window = fields["num_layers"], fields["sliding_window"] or 0
    local = gguf_windowed_layers(meta, arch, layers, pattern)
    heads, head_dim = fields["num_heads"], fields["head_dim"]
    return dict(
        sliding_window=None, layer_windows=tuple(window if is_local else 0 for is_local in local),
        rms_norm_offset=0.0, sandwich_norms=True, embed_scale=True, activation="gelu_tanh",
        attn_scale=(fields["hidden_size"] / heads if layers == big_layers else head_dim) ** -0.5,
        final_soft_cap=meta.get(f"{arch}.final_logit_softcapping") or None)


def gguf_windowed_layers(meta: dict[str, Any], arch: str, layers: int, pattern: int) -> list[bool]:
    """Which layers a GGUF file's metadata windows, as llama.cpp reads them: `attention.sliding_window_pattern`,
    one flag per layer or an int n (every n-th layer global, 0: none), else the architecture's `pattern`."""
    flags = meta.get(f"{arch}.attention.sliding_window_pattern", pattern)
    if np.ndim(flags):  # one flag per layer
        local = [bool(f) for f in flags]
        if len(local) != layers:
            raise ConfigError(f"attention.sliding_window_pattern has {len(local)} flags for {layers} layers")
        return local
    n = int(flags)
    return [n == 0 or i % n < n - 1 for i in range(layers)]


def read_gguf(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    out = gemma_gguf_config(meta, arch, {**fields, "sliding_window": fields["sliding_window"] or 4096}, pattern=2,
                            big_layers=46)
    out["attn_soft_cap"] = float(meta.get(f"{arch}.attn_logit_softcapping", 50.0))
    out["final_soft_cap"] = float(meta.get(f"{arch}.final_logit_softcapping", 30.0))
    base = meta.get(f"{arch}.rope.freq_base_swa")
    if base is not None and float(base) != fields["rope"].theta:
        out["local_rope"] = RopeConfig(theta=float(base))
    return out


SPEC = FamilySpec("Gemma2ForCausalLM", gguf_arch="gemma2", tie_default=True, config_reader=read_config,
                  gguf_config_reader=read_gguf, gguf_layer_names=GEMMA_GGUF_LAYER_NAMES)
