"""A GGUF mixture of experts kept quantized: its experts' blocks stay packed in the model ([layers, experts, out,
...]) and each step multiplies only the routed experts (the grouped CPU kernel, a custom call), or dequantizes them
in the step (the jnp reference, what GPU and TPU run); both against the same file loaded as float weights, and a
sequence's logits the same bits alone or beside others."""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxllm.loading import load_model
from pallas_kernels.quantized_matmul.cpu import grouped_target
from pallas_kernels.quantized_matmul.isa import best
from tests.gguf_writer import write_moe_gguf
from tests.paged_driver import PagedRunner

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", params=[T.Q8_0, T.Q4_1], ids=["q8_0", "q4_1"])
def moe_file(request, tiny_model_dir, tmp_path_factory):
    _, hf_model = tiny_model_dir("qwen3_moe")
    return write_moe_gguf(hf_model, tmp_path_factory.mktemp("moe") / f"{request.param.name}.gguf", request.param)


def _paged(lm, seqs):
    runner = PagedRunner(lm.model, num_pages=16, page_size=4)
    return runner.step(dict(enumerate(seqs)), all_logits=True)


SEQS = [[5, 900, 17, 33, 250, 4, 61], [44, 3, 1000, 8, 76, 19, 500, 7, 7], [12, 13]]


@pytest.mark.parametrize("matmul_impl", ["cpu", "reference"])
def test_quantized_experts_match_the_float_load_of_the_same_file(moe_file, matmul_impl):
    lm = load_model(moe_file, dtype="float32", matmul_impl=matmul_impl)
    plan = dict(lm.model.quantization)
    assert plan["experts.gate_up_proj"].name == plan["experts.down_proj"].name == moe_file.stem.lower()
    experts = lm.model.layers.layer.mlp.experts
    assert experts.gate_up_proj.weight[...].dtype in (jnp.int8, jnp.uint8)
    assert experts.gate_up_proj.weight_scale[...].shape[:2] == (lm.config.num_layers, lm.config.num_experts)
    float_lm = load_model(moe_file, dtype="float32", quantization="none", matmul_impl="reference")
    got, want = _paged(lm, SEQS), _paged(float_lm, SEQS)
    for i in range(len(SEQS)):
        # the CPU kernel quantizes its inputs to int8 blocks (as llama.cpp does): close, not equal
        np.testing.assert_allclose(got[i], want[i], atol=3e-2 if matmul_impl == "cpu" else 1e-4, rtol=0)
    if matmul_impl == "cpu" and best() is not None:
        # the step calls the grouped kernel, and a sequence's logits are the same bits with or without neighbours
        assert grouped_target(best()) in _step_text(lm)
        alone = _paged(lm, SEQS[1:2])
        np.testing.assert_array_equal(alone[0], got[1])


def _step_text(lm) -> str:
    import jax

    from jaxllm.attention_metadata import AttentionMetadata

    cfg = lm.config
    kv = (jnp.zeros((cfg.num_kv_heads, cfg.num_layers * 4, 4, cfg.head_dim)),) * 2
    meta = AttentionMetadata(slot_mapping=jnp.zeros((2,), jnp.int32), kv_lens=jnp.ones((1,), jnp.int32),
                             block_tables=jnp.zeros((1, 4), jnp.int32),
                             query_start_loc=jnp.asarray([0, 2], jnp.int32))
    return jax.jit(lambda ids: lm.model.forward_paged(ids, jnp.zeros((2,), jnp.int32), kv, meta)[0]).lower(
        jnp.zeros((2,), jnp.int32)).as_text()
