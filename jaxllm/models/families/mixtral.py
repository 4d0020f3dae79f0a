"""Mixtral: Mistral's attention with a mixture of experts in every layer (`intermediate_size` wide each, the
router's top-k always renormalised). Its checkpoints name the layer's MLP `block_sparse_moe` and the experts'
gate / down / up projections `w1`, `w2`, `w3`."""

from jaxllm.models.families.moe_config import MOE_QUANTIZABLE, moe_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="intermediate_size",
                      norm_topk_default=True)


SPEC = FamilySpec("MixtralForCausalLM", sliding_window_default=True, config_reader=read_config, mlp=MoE,
                  quantizable=MOE_QUANTIZABLE,
                  hf_module_names={"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
