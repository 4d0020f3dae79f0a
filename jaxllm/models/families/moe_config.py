"""How the mixture-of-experts families' config.json read (`num_experts`, top-k, expert width), shared by
Mixtral, Qwen2-MoE and Qwen3-MoE; only MoE layers throughout (`decoder_sparse_step` 1, no `mlp_only_layers`)."""

from __future__ import annotations

from typing import Any

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.models.family import EXPERT_QUANTIZABLE, LLAMA_GGUF_LAYER_NAMES, FamilySpec, llama_config

# Attention's, the embeddings' and the experts' (a shared expert stays float).
MOE_QUANTIZABLE = ("qkv_proj", "o_proj", "embed_tokens", "lm_head", *EXPERT_QUANTIZABLE)


def moe_config(hf: dict[str, Any], spec: FamilySpec, *, width_key: str, norm_topk_default: bool,
               **overrides) -> ModelConfig:
    """The expert count is `num_experts` or `num_local_experts` (Mixtral's, and the name transformers 5 writes
    for every family); `width_key` names the experts' width."""
    if int(hf.get("decoder_sparse_step", 1)) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("dense layers among the experts' (decoder_sparse_step != 1 or mlp_only_layers) are not "
                          "supported")
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if experts is None or width_key not in hf:
        raise ConfigError(f"missing the field {'num_experts' if experts is None else width_key!r}")
    experts, width = int(experts), int(hf[width_key])
    return llama_config(hf, spec, num_experts=experts, num_experts_per_tok=int(hf.get("num_experts_per_tok", 2)),
                        moe_intermediate_size=width,
                        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_default)), **overrides)


# llama.cpp's names: each layer's experts stacked per projection, the router `ffn_gate_inp`, a shared expert `shexp`
MOE_GGUF_LAYER_NAMES = {**LLAMA_GGUF_LAYER_NAMES, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
                        "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
                        "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
                        "ffn_down_shexp": "mlp.shared_expert.down_proj",
                        "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}


def moe_gguf_config(meta: dict[str, Any], arch: str, fields: dict[str, Any], *, norm_topk_prob: bool,
                    width_key: str | None = "expert_feed_forward_length") -> dict[str, Any]:
    """The experts a GGUF file's metadata describes (`width_key` None: as wide as `feed_forward_length`, Mixtral's),
    and whether its router renormalises the top-k (as llama.cpp runs that architecture)."""
    def get(key):
        if f"{arch}.{key}" not in meta:
            raise ConfigError(f"metadata {arch}.{key} is missing")
        return int(meta[f"{arch}.{key}"])

    out = dict(num_experts=get("expert_count"), num_experts_per_tok=get("expert_used_count"),
               moe_intermediate_size=get(width_key) if width_key else fields["intermediate_size"],
               norm_topk_prob=norm_topk_prob)
    if f"{arch}.expert_shared_feed_forward_length" in meta:
        out["shared_expert_intermediate_size"] = get("expert_shared_feed_forward_length")
    return out
