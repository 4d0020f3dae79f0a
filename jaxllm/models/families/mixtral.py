"""Mixtral: Mistral's attention with a mixture of experts in every layer (`intermediate_size` wide each, the
router's top-k always renormalised). Its checkpoints name the layer's MLP `block_sparse_moe` and the experts'
gate / down / up projections `w1`, `w2`, `w3`. Its GGUF files are llama.cpp's "llama" ones with experts
(`llama.expert_count`; q/k rows in llama.cpp's order), each layer's experts stacked per projection."""

from jaxllm.models.families.moe_config import MOE_GGUF_LAYER_NAMES, MOE_QUANTIZABLE, moe_config, moe_gguf_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE


def read_config(hf, spec):
    return moe_config(hf, spec, width_key="intermediate_size", norm_topk_default=True)


def read_gguf(meta, arch, fields):
    return moe_gguf_config(meta, arch, fields, norm_topk_prob=True, width_key=None)


SPEC = FamilySpec("MixtralForCausalLM", gguf_arch="llama", gguf_when=lambda meta: bool(meta.get("llama.expert_count")),
                  permuted_qk_in_gguf=True, gguf_config_reader=read_gguf, gguf_layer_names=MOE_GGUF_LAYER_NAMES,
                  sliding_window_default=True, config_reader=read_config, mlp=MoE, quantizable=MOE_QUANTIZABLE,
                  hf_module_names={"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"})
