"""The model's matmul kernel choice (`matmul_impl`): every linear layer and the tied LM head follow it, and
the CPU kernel gives the same logits as XLA's dot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.kernels import choose_kernels
from jaxllm.models.layers import Embed, Linear
from jaxllm.models.llama import LlamaForCausalLM
from pallas_kernels.skinny_matmul import cpu

CFG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=True)


def _model(impl):
    return LlamaForCausalLM(CFG, dtype=jnp.float32, matmul_impl=impl, rngs=nnx.Rngs(0))


def _lowered(model, ids):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids)).lower(state, ids).as_text()


def test_every_linear_follows_the_models_choice():
    model = _model("reference")
    impls = {m.matmul_impl for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, Embed))}
    assert impls == {"reference"}
    model.set_matmul_impl("cpu")
    assert {m.matmul_impl for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, Embed))} == {"cpu"}


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (1, 8)])
def test_cpu_kernel_logits_match_xla_dot(shape):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, shape), jnp.int32)
    reference, kernel = _model("reference"), _model("cpu")
    assert cpu.TARGET in _lowered(kernel, ids)  # 2 layers x 4 linears + the tied head, all on the kernel
    assert _lowered(kernel, ids).count(cpu.TARGET) >= 2 * 4 + 1
    assert cpu.TARGET not in _lowered(reference, ids)
    np.testing.assert_allclose(np.asarray(kernel(ids)), np.asarray(reference(ids)), rtol=1e-5, atol=1e-5)


def test_unknown_matmul_impl_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown matmul implementation 'fast'"):
        choose_kernels(matmul_impl="fast")
    with pytest.raises(ValueError, match="unknown matmul implementation"):
        _model("fast")
