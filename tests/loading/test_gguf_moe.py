"""Mixture-of-experts GGUF files as llama.cpp's converter writes them (Qwen3-MoE's "qwen3moe", Qwen2-MoE's
"qwen2moe" with its shared expert, Mixtral's "llama" with experts; each layer's experts stacked per projection, the
router in `ffn_gate_inp`, expert count, top-k and width in the metadata): float32 logits equal transformers', and
a Q8_0 Qwen3-MoE file (experts kept quantized, multiplied by the grouped kernel) keeps transformers' greedy tokens
up to Q8_0's rounding. (llama.cpp's llama-server gave the same greedy tokens on the float32 Qwen3-MoE file: checked
by hand, the suite does not build llama.cpp.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxllm import LLM
from jaxllm.loading import load_model
from tests.gguf_writer import write_moe_gguf
from tests.quantized_greedy import assert_greedy_within

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # a GGUF family's engines


@pytest.mark.parametrize("case", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_f32_moe_gguf_matches_transformers(case, tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir(case)
    lm = load_model(write_moe_gguf(hf_model, tmp_path / "moe.gguf"), dtype="float32", attn_impl="reference")
    cfg, hf = lm.config, hf_model.config
    assert cfg.architecture == hf.architectures[0]
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, hf.num_experts_per_tok)
    assert cfg.norm_topk_prob == (case != "qwen2_moe")
    ids = np.random.default_rng(0).integers(3, 1024, (1, 14))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray(ids))), expected, atol=1e-4, rtol=0)


def test_q8_0_qwen3_moe_gguf_greedy_within_quantization(tiny_model_dir, tmp_path):
    """Every greedy token is transformers' top token after the same prefix, or within 0.1 of its logit."""
    _, hf_model = tiny_model_dir("qwen3_moe")
    path = write_moe_gguf(hf_model, tmp_path / "moe-q8_0.gguf", T.Q8_0)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=64, page_size=4)
    plan = dict(llm.engine.model.quantization)
    assert plan["qkv_proj"].name == plan["experts.gate_up_proj"].name == plan["experts.down_proj"].name == "q8_0"
    rng = np.random.default_rng(5)
    assert_greedy_within(llm, hf_model, [rng.integers(3, 1024, n).tolist() for n in (8, 13, 21)])


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_q8_0_experts_split_whole_over_two_devices_as_by_rows(tiny_model_dir, tmp_path):
    """--enable-expert-parallel on a quantized file: the experts' blocks split whole over the devices give the
    logits of each expert's rows split over them (the same kernels on both)."""
    from tests.test_sharding import _logits

    _, hf_model = tiny_model_dir("qwen3_moe")
    path = write_moe_gguf(hf_model, tmp_path / "moe-q8_0.gguf", T.Q8_0)
    ids = np.random.default_rng(3).integers(0, 1024, (2, 9))
    rows = load_model(path, dtype="float32", tensor_parallel_size=2)
    whole = load_model(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    data = whole.model.layers.layer.mlp.experts.down_proj.weight[...]  # [layers, experts, out, in] int8
    assert data.addressable_shards[0].data.shape[1:] == (4, *data.shape[2:])
    for got, want in zip(_logits(whole, ids), _logits(rows, ids), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
