"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) with a mixture of experts in every
layer plus a shared expert every token runs, scaled by a sigmoid gate (`shared_expert_gate`)."""

from jaxllm.models.families.moe_config import MOE_QUANTIZABLE, moe_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="moe_intermediate_size",
                      norm_topk_default=False,
                      shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0))


SPEC = FamilySpec("Qwen2MoeForCausalLM", attention_bias_default=True, o_bias_follows_attention_bias=False,
                  config_reader=read_config, mlp=MoE, quantizable=MOE_QUANTIZABLE)
