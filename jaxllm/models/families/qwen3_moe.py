"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms) with a mixture of experts in every
layer (`jaxllm.models.moe.MoE`), the router's top-k renormalised when `norm_topk_prob`."""

from jaxllm.models.families.moe_config import MOE_QUANTIZABLE, moe_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="moe_intermediate_size",
                      norm_topk_default=False)


SPEC = FamilySpec("Qwen3MoeForCausalLM", qk_norm=True, config_reader=read_config, mlp=MoE,
                  quantizable=MOE_QUANTIZABLE)
