"""The one kernel decision (`jaxllm.kernels.choose_kernels`): its rules for each platform, dtype and
tensor-parallel size, its errors, and a model following it everywhere."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxllm.config import ModelConfig
from jaxllm.kernels import Kernels, choose_kernels
from jaxllm.models.layers import Embed, Linear, RMSNorm
from jaxllm.models.llama import LlamaForCausalLM

F32, BF16 = jnp.float32, jnp.bfloat16


@pytest.mark.parametrize(("platform", "dtype", "tp", "want"), [
    ("cpu", F32, 1, ("cpu", "cpu", False)),
    ("cpu", BF16, 1, ("cpu", "reference", False)),  # the matmul kernel is float32 only; attention reads 16-bit caches
    ("cpu", F32, 2, ("reference", "reference", False)),  # GSPMD cannot split an opaque custom call
    ("cpu", (F32, BF16), 1, ("cpu", "cpu", False)),  # float32 weights, a bfloat16 KV cache
    ("cpu", (F32, jnp.float8_e4m3fn), 1, ("reference", "cpu", False)),  # no float8 caches in the CPU kernel
    ("tpu", BF16, 8, ("pallas_tpu", "reference", False)),
    ("gpu", BF16, 1, ("pallas_gpu", "pallas_gpu", False)),  # the skinny matmul for decode steps
    ("cuda", jnp.float16, 1, ("pallas_gpu", "pallas_gpu", False)),
    ("gpu", F32, 1, ("pallas_gpu", "reference", False)),  # float32 matmuls stay XLA's (HIGHEST precision)
    ("gpu", BF16, 2, ("pallas_gpu", "reference", False)),  # GSPMD cannot split a Pallas call's rows
])
def test_auto_choices(platform, dtype, tp, want):
    dtype, kv_dtype = dtype if isinstance(dtype, tuple) else (dtype, None)
    k = choose_kernels(platform=platform, dtype=dtype, kv_dtype=kv_dtype, tensor_parallel_size=tp)
    assert (k.attention, k.matmul, k.interpret) == want


def test_a_pallas_kernel_off_its_platform_is_interpreted_unless_told_otherwise():
    assert choose_kernels("pallas_tpu", platform="cpu").interpret
    assert choose_kernels("pallas_gpu", platform="cpu").interpret
    assert choose_kernels("reference", "pallas_gpu", platform="cpu").interpret  # the matmul kernel alone
    assert not choose_kernels("pallas_tpu", platform="cpu", interpret=False).interpret  # lowers natively
    assert not choose_kernels("pallas_tpu", platform="tpu").interpret


def test_the_layer_loop_is_unrolled_on_gpu_only():
    """XLA:GPU fuses a static slice of a stacked weight into the GEMM but copies a scan's dynamic slice out first
    (benchmarks/gpu_hlo_report.py); elsewhere the scan stays (one layer to compile)."""
    assert choose_kernels(platform="gpu", dtype=BF16).layer_loop == "unrolled"
    assert choose_kernels(platform="tpu", dtype=BF16).layer_loop == "scan"
    assert choose_kernels(platform="cpu").layer_loop == "scan"
    assert choose_kernels(platform="gpu", dtype=BF16, layer_loop="scan").layer_loop == "scan"
    assert choose_kernels(platform="cpu", layer_loop="unrolled").layer_loop == "unrolled"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"layer_loop": "while"}, "unknown layer loop 'while'"),
    ({"attn_impl": "flash"}, "unknown attention implementation 'flash'"),
    ({"matmul_impl": "fast"}, "unknown matmul implementation 'fast'"),
    ({"attn_impl": "cpu", "platform": "tpu"}, "the cpu attention kernel runs on CPU only"),
    ({"matmul_impl": "cpu", "platform": "gpu"}, "the cpu matmul kernel runs on CPU only"),
    ({"attn_impl": "cpu", "platform": "cpu", "kv_dtype": jnp.float8_e5m2},
     "reads float32, float16 or bfloat16 caches, not float8_e5m2"),
    ({"platform": "metal"}, "unknown platform 'metal'"),
])
def test_impossible_choices_are_errors_not_fallbacks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        choose_kernels(**kwargs)


def test_the_model_and_every_linear_follow_one_choice():
    cfg = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    kernels = choose_kernels(platform="tpu", dtype=BF16)
    model = LlamaForCausalLM(cfg, dtype=BF16, kernels=kernels, rngs=None)
    assert model.kernels == kernels == Kernels("pallas_tpu", "reference", "tpu", False)
    modules = [m for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, Embed, RMSNorm))]
    assert len(modules) == 2 * 4 + 1 + 2 * 2 + 1 and {m.kernels for m in modules} == {kernels}
    model.set_matmul_impl("reference")
    assert model.kernels.attention == "pallas_tpu" and model.matmul_impl == "reference"
    default = LlamaForCausalLM(cfg, rngs=None)
    assert default.kernels == choose_kernels(platform=jax.default_backend())


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_a_norm_sums_rows_in_a_fixed_order_on_cpu_only(platform):
    """On CPU a row's norm must not depend on how many rows its step has (XLA:CPU orders a reduction by shape); on
    GPU the norm is XLA's one row reduction, not the fixed order's chain of slice-adds (more kernels a step)."""
    norm = RMSNorm(576, 1e-5, rngs=nnx.Rngs(0))
    norm.kernels = choose_kernels(platform=platform, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(0), (16, 576), jnp.float32)
    hlo = jax.jit(norm.__call__).lower(x).as_text()
    assert ("slice" in hlo) == (platform == "cpu")
    if platform == "cpu":
        whole = jax.jit(norm.__call__)(x)
        for rows in (1, 3, 7, 9):
            assert (jax.jit(norm.__call__)(x[:rows]) == whole[:rows]).all(), rows
