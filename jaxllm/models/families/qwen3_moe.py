"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) with a mixture of experts in every
layer (`jaxllm.models.moe.MoE`), the router's top-k renormalised when `norm_topk_prob`.

Its GGUF files (llama.cpp's "qwen3moe") hold each layer's experts in one tensor per projection (`ffn_gate_exps`,
`ffn_up_exps`, `ffn_down_exps`, [experts, out, in]) and the router in `ffn_gate_inp`; llama.cpp always renormalises
the top-k (every Qwen3-MoE checkpoint has `norm_topk_prob`). The experts load as float."""

from jaxllm.models.families.moe_config import MOE_GGUF_LAYER_NAMES, MOE_QUANTIZABLE, moe_config, moe_gguf_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="moe_intermediate_size", norm_topk_default=False)


def read_gguf(meta, arch, fields):
    return moe_gguf_config(meta, arch, fields, norm_topk_prob=True)


SPEC = FamilySpec("Qwen3MoeForCausalLM", gguf_arch="qwen3moe", qk_norm=True, config_reader=read_config, mlp=MoE,
                  quantizable=MOE_QUANTIZABLE, gguf_config_reader=read_gguf, gguf_layer_names=MOE_GGUF_LAYER_NAMES)
