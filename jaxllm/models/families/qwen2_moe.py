"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a mixture of experts in every
layer plus a shared expert every token runs, scaled by a sigmoid gate (`shared_expert_gate`). Its GGUF files
(llama.cpp's "qwen2moe") name the shared expert's tensors `*_shexp`; llama.cpp does not renormalise the top-k."""

from jaxllm.models.families.moe_config import MOE_GGUF_LAYER_NAMES, MOE_QUANTIZABLE, moe_config, moe_gguf_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="moe_intermediate_size",
                      norm_topk_default=False,
                      shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))


def read_gguf(meta, arch, fields):
    return moe_gguf_config(meta, arch, fields, norm_topk_prob=False)


SPEC = FamilySpec("Qwen2MoeForCausalLM", gguf_arch="qwen2moe", attention_bias_default=True,
                  o_bias_follows_attention_bias=False, config_reader=read_config, mlp=MoE, quantizable=MOE_QUANTIZABLE,
                  gguf_config_reader=read_gguf, gguf_layer_names=MOE_GGUF_LAYER_NAMES)
