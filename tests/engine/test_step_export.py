"""The engine's real step (forward through the paged cache, LM head, sampler), built by `ModelRunner` for a
GPU or TPU from this CPU host, with abstract weights at Llama-3.1 shapes, exports with `jax.export` with the
native kernel: the TPU kernel's Mosaic call for `tpu`, the Triton call for `cuda`; the 70B preset's step
exports for an 8-device TPU mesh with the weights and KV cache split as the sharding rules say.

Sampled buckets (each export takes seconds): the smallest, one middle and the largest of each preset."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax import export

from jaxllm.config import ModelConfig
from jaxllm.engine.config import EngineConfig
from jaxllm.engine.model_runner import ModelRunner
from jaxllm.kernels import choose_kernels
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.plan import bundled_model_config
from jaxllm.sharding import make_mesh, shard_abstract
from pallas_kernels.quantized_matmul import QuantFormat
from pallas_kernels.quantized_matmul.format import INT8

LLAMA_8B = bundled_model_config("meta-llama/Llama-3.1-8B-Instruct")
LLAMA_70B = bundled_model_config("meta-llama/Llama-3.1-70B-Instruct")
# The kernels' custom calls in the exported module (not allowed by jax.export unless named).
NATIVE_CALL = {"tpu": "tpu_custom_call", "cuda": "__gpu$xla.gpu.triton"}


def _runner(cfg: ModelConfig, preset: str, platform: str, mesh=None, kv_dtype=None,
            quantization=None, experts_over_tp: bool = False) -> tuple[ModelRunner, list[str]]:
    engine = EngineConfig.from_preset(preset)
    kernels = choose_kernels("auto", engine.matmul_impl, platform=platform, dtype=jnp.bfloat16, interpret=False,
                             kv_dtype=kv_dtype, tensor_parallel_size=engine.tensor_parallel_size, mesh=mesh)
    model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, kernels=kernels, rngs=None,  # abstract weights
                             quantization=quantization)
    model.stack_layers()
    if mesh is not None:
        shard_abstract(model, mesh, experts_over_tp)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.split(model)[1])[0]]
    runner = ModelRunner(model, num_pages=16, page_size=engine.page_size, max_model_len=engine.max_model_len,
                         buckets=engine.buckets(), eos_token_ids=(128009,), mesh=mesh, kv_cache_dtype=kv_dtype)
    return runner, paths


def _export(runner: ModelRunner, bucket: tuple[int, int], platform: str) -> export.Exported:
    checks = [export.DisabledSafetyCheck.custom_call(NATIVE_CALL[platform])]
    return export.export(runner.executables.jitted, platforms=[platform],
                         disabled_checks=checks)(*runner.abstract_args(bucket))


def _sampled(buckets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [buckets[0], buckets[len(buckets) // 2], buckets[-1]]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_8b_step_exports_with_the_native_kernel(platform):
    runner, _ = _runner(LLAMA_8B, "llama-3.1-8b-h100", platform)
    assert len(runner.buckets) == 14
    for bucket in _sampled(runner.buckets):
        exported = _export(runner, bucket, platform)
        text = exported.mlir_module()
        assert exported.platforms == (platform,)
        assert NATIVE_CALL[platform] in text, bucket
        # One scanned layer: the attention kernel appears once in the module, not once per layer.
        attention = text.count(NATIVE_CALL[platform]) if platform == "tpu" else \
            text.count('name = "ragged_paged_attention_gpu"')
        assert 1 <= attention <= 2, bucket
        if platform == "cuda":  # a decode step of few rows multiplies in the Pallas skinny matmul
            assert ('name = "skinny_matmul_gpu"' in text) == (bucket[0] <= 16), bucket
        assert "stablehlo.while" in text
        tokens, seqs = bucket
        packed = exported.out_avals[-5]  # tokens, logprobs, ranks, top-20 ids, top-20 logprobs: int32 rows
        assert packed.shape == (seqs, 3 + 2 * 20) and packed.dtype == jnp.int32
        pooled = exported.out_avals[-4]  # each sequence's first, last and summed hidden state (pooling requests)
        assert pooled.shape == (seqs, 3, 4096) and pooled.dtype == jnp.float32
        assert exported.out_avals[-3].shape == (seqs, 0)  # a classifier head's outputs: none here
        next_ids = exported.out_avals[-2]  # the tokens as the next decode step's ids (async scheduling)
        assert next_ids.shape == (tokens,) and next_ids.dtype == jnp.int32
        prompt = exported.out_avals[-1]  # each row's prompt logprob, rank and top 20 (prompt_logprobs requests)
        assert prompt.shape == (tokens, 2 + 2 * 20) and prompt.dtype == jnp.int32


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_float8_kv_cache_exports_with_the_native_kernel(platform, kv_dtype):
    runner, _ = _runner(LLAMA_8B, "llama-3.1-8b-h100", platform, kv_dtype=kv_dtype)
    assert runner.caches[0].dtype == kv_dtype
    module = _export(runner, runner.buckets[1], platform).mlir_module()
    assert NATIVE_CALL[platform] in module
    assert ("f8E4M3FN" if kv_dtype == jnp.float8_e4m3fn else "f8E5M2") in module  # the cache's element type


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_weight_only_quantized_steps_export(platform, quant):
    """int8 (per channel: XLA's dot on the int8 weights, the scale on the output) and 4-bit (unpacked through
    JAX's uint4 type, the conversion fused by XLA) weight-only steps at 8B shapes lower for GPU and TPU."""
    fmt = INT8 if quant == "int8" else QuantFormat(4, 32, True, "float16", name="q4_1")
    plan = {role: fmt for role in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")}
    runner, paths = _runner(LLAMA_8B, "llama-3.1-8b-h100", platform, quantization=plan)
    module = _export(runner, runner.buckets[1], platform).mlir_module()
    assert NATIVE_CALL[platform] in module
    down_proj = "tensor<32x4096x14336xi8>" if quant == "int8" else "tensor<32x4096x7168xui8>"
    assert down_proj in module  # the stacked weights arrive packed, as they are held
    if quant == "int4":
        assert "ui4" in module  # unpacked through the uint4 type
    assert any("weight_scale" in p for p in paths)


def _arg_shardings(module: str) -> list[str]:
    """The Shardy sharding of each argument of the exported module's main function, in order."""
    signature = re.search(r"func\.func public @main\((.*?)\) ->", module, re.S).group(1)
    return [m.group(1) if (m := re.search(r"sdy\.sharding = #sdy\.sharding<@mesh, (\[.*?\])>", arg)) else "none"
            for arg in signature.split("%arg")[1:]]


def _spec_of(paths: list[str], args: list[str]):
    """fragment -> the sharding of the one parameter whose path holds `fragment` (args: `_arg_shardings`)."""
    shardings = dict(zip(paths, args, strict=False))

    def spec(fragment: str) -> str:
        (match,) = [s for p, s in shardings.items() if fragment in p]
        return match
    return spec


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs --xla_force_host_platform_device_count=8")
def test_the_70b_tp8_step_exports_for_tpu_with_the_intended_shardings():
    mesh = make_mesh(8)
    runner, paths = _runner(LLAMA_70B, "llama-3.1-70b-tp8", "tpu", mesh)
    bucket = runner.buckets[len(runner.buckets) // 2]
    exported = _export(runner, bucket, "tpu")
    module = exported.mlir_module()
    assert exported.nr_devices == 8 and NATIVE_CALL["tpu"] in module
    assert "sdy.manual_computation" in module  # the kernel runs per device (shard_map), not partitioned by GSPMD
    args = _arg_shardings(module)
    spec = _spec_of(paths, args)

    # Stacked weights [layers, out, in]: column-parallel rows split 8 ways, row-parallel columns split 8 ways,
    # the layer axis never; norms replicated; the vocabulary split.
    assert spec("'qkv_proj']['weight'") == spec("'gate_up_proj']['weight'") == '[{}, {"tp"}, {}]'
    assert spec("'o_proj']['weight'") == spec("'down_proj']['weight'") == '[{}, {}, {"tp"}]'
    assert spec("'input_layernorm']['weight'") == "[{}, {}]"
    assert spec("['embed_tokens']['embedding']") == spec("['lm_head']['weight']") == '[{"tp"}, {}]'
    k_cache, v_cache = args[len(paths):len(paths) + 2]
    assert k_cache == v_cache == '[{"tp"}, {}, {}, {}]'  # each device holds its KV heads of every page


QWEN3_MOE = bundled_model_config("Qwen/Qwen3-30B-A3B")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_qwen3_moe_step_exports_with_a_grouped_matmul(platform):
    """Qwen3-30B-A3B's shapes (128 experts, 8 per token): the experts' matmuls are grouped (`ragged_dot`), one
    scanned layer."""
    runner, _ = _runner(QWEN3_MOE, "llama-3.1-8b-h100", platform)
    module = _export(runner, runner.buckets[1], platform).mlir_module()
    assert NATIVE_CALL[platform] in module and "stablehlo.while" in module
    assert "ragged_dot" in module
    assert "tensor<48x128x1536x2048xbf16>" in module  # every layer's experts' gate/up, stacked


GPT_OSS = bundled_model_config("openai/gpt-oss-20b")


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_gpt_oss_step_exports_with_sinks_and_grouped_experts(platform):
    """gpt-oss-20b's shapes (32 experts, 4 per token, 64 heads' sinks, alternating 128-token windows): the native
    attention kernel takes the sinks, the experts' matmuls are grouped, one scanned layer."""
    assert GPT_OSS.attention_sinks and GPT_OSS.num_experts == 32 and GPT_OSS.layer_windows[:2] == (128, 0)
    runner, paths = _runner(GPT_OSS, "llama-3.1-8b-h100", platform)
    module = _export(runner, runner.buckets[1], platform).mlir_module()
    assert NATIVE_CALL[platform] in module and "stablehlo.while" in module and "ragged_dot" in module
    assert "tensor<24x64xf32>" in module  # every layer's sinks, stacked
    assert "tensor<24x32x5760x2880xbf16>" in module  # every layer's experts' gate/up


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs --xla_force_host_platform_device_count=8")
def test_the_qwen3_moe_ep8_step_exports_for_tpu_with_the_experts_split():
    mesh = make_mesh(1, expert_parallel_size=8)
    runner, paths = _runner(QWEN3_MOE, "llama-3.1-8b-h100", "tpu", mesh)
    exported = _export(runner, runner.buckets[1], "tpu")
    module = exported.mlir_module()
    assert exported.nr_devices == 8 and NATIVE_CALL["tpu"] in module
    spec = _spec_of(paths, _arg_shardings(module))

    # [layers, experts, out, in]: the experts split 8 ways (and each expert's rows over tp, of 1 device here);
    # attention whole on every device
    assert spec("['experts']['gate_up_proj']['weight'") == '[{}, {"ep"}, {"tp"}, {}]'
    assert spec("['experts']['down_proj']['weight'") == '[{}, {"ep"}, {}, {"tp"}]'
    assert "ep" not in spec("'qkv_proj']['weight'") and "ep" not in spec("['gate']['weight'")


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs --xla_force_host_platform_device_count=4")
def test_the_qwen3_moe_step_exports_for_tpu_with_whole_experts_over_the_tp_devices():
    """vLLM's --enable-expert-parallel on 4 devices: the 128 experts 32 a device, each expert's rows whole;
    attention split by heads over the same devices."""
    mesh = make_mesh(4)
    runner, paths = _runner(QWEN3_MOE, "llama-3.1-8b-h100", "tpu", mesh, experts_over_tp=True)
    exported = _export(runner, runner.buckets[1], "tpu")
    module = exported.mlir_module()
    assert exported.nr_devices == 4 and NATIVE_CALL["tpu"] in module
    spec = _spec_of(paths, _arg_shardings(module))

    # [layers, experts, out, in]
    assert spec("['experts']['gate_up_proj']['weight'") == '[{}, {"tp"}, {}, {}]'
    assert spec("['experts']['down_proj']['weight'") == '[{}, {"tp"}, {}, {}]'
    assert spec("'qkv_proj']['weight'") == '[{}, {"tp"}, {}]'
