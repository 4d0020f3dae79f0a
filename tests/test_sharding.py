"""Tensor parallelism over 4 host CPU devices gives the same logits as one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.config import ConfigError
from jaxllm.loading import load_model
from jaxllm.plan import bundled_model_config
from jaxllm.sharding import logical_rules, make_mesh
from tests.matrix import sampled
from tests.paged_driver import PagedRunner


def _logits(lm, ids):
    dense = np.asarray(lm.model(jnp.asarray(ids)))
    runner = PagedRunner(lm.model, num_pages=8, page_size=4, mesh=lm.mesh)
    paged = runner.step({0: ids[0].tolist(), 1: ids[1].tolist()}, all_logits=True)
    return dense, np.stack([paged[0], paged[1]])


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs --xla_force_host_platform_device_count=4")
@pytest.mark.parametrize("tp", sampled([2, 4], lambda tp: tp == 2))
def test_tensor_parallel_matches_single_device(tp, tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2_tp")
    ids = np.random.default_rng(1).integers(0, 1024, (2, 9))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=1), ids)
    lm = load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=tp)
    # Stacked over layers: [layers, (heads + 2 kv_heads) * head_dim, hidden]
    qkv = lm.model.layers.layer.self_attn.qkv_proj.weight[...]
    cfg = lm.config
    assert len(qkv.sharding.device_set) == tp  # really sharded
    assert qkv.addressable_shards[0].data.shape == (
        cfg.num_layers, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp, cfg.hidden_size)
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_tensor_parallel_must_divide_heads(smollm2_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 must divide num_attention_heads=9"):
        load_model(smollm2_path, tensor_parallel_size=2)


def test_mesh_larger_than_device_count():
    with pytest.raises(ConfigError, match="needs that many devices"):
        make_mesh(len(jax.devices()) + 1)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_auto_kernels_under_tensor_parallel_on_cpu_are_the_partitionable_references(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2_tp")
    tp2 = load_model(folder, dtype="float32", tensor_parallel_size=2).model
    assert (tp2.attn_impl, tp2.matmul_impl, tp2.layers.layer.mlp.down_proj.matmul_impl) == ("reference",) * 3
    tp1 = load_model(folder, dtype="float32", tensor_parallel_size=1).model
    assert (tp1.attn_impl, tp1.matmul_impl) == ("cpu", "cpu")


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_a_pallas_kernel_under_tensor_parallel_runs_per_device(tiny_model_dir):
    """GSPMD cannot partition a Pallas call: under TP it runs in shard_map on each device's KV heads (here in
    Pallas' interpreter), with the same logits as one device."""
    folder, _ = tiny_model_dir("qwen2_tp")
    ids = np.random.default_rng(2).integers(0, 1024, (2, 6))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=1), ids)[1]
    lm = load_model(folder, dtype="float32", attn_impl="pallas_tpu", tensor_parallel_size=2)
    assert lm.model.kernels.mesh is lm.mesh and lm.model.kernels.interpret
    np.testing.assert_allclose(_logits(lm, ids)[1], single, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs --xla_force_host_platform_device_count=4")
def test_int8_weights_under_tensor_parallel(tiny_model_dir):
    """Quantized weights shard like float ones (values and scales split along the same axes); GSPMD runs the
    reference quantized matmul per device."""
    folder, _ = tiny_model_dir("qwen2_tp")
    ids = np.random.default_rng(2).integers(0, 1024, (2, 9))
    single = _logits(load_model(folder, dtype="float32", quantization="int8", tensor_parallel_size=1), ids)
    lm = load_model(folder, dtype="float32", quantization="int8", tensor_parallel_size=2)
    down = lm.model.layers.layer.mlp.down_proj
    assert down.weight[...].dtype == jnp.int8 and len(down.weight[...].sharding.device_set) == 2
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_separate_layers_keep_their_split(tiny_model_dir):
    """The GPU's layout (the unrolled layer loop keeps the layers separate: `arrange_layers`) under tensor
    parallelism: each layer's weights stay split as the stack was, with the same logits as one device."""
    import dataclasses

    folder, _ = tiny_model_dir("qwen2_tp")
    ids = np.random.default_rng(3).integers(0, 1024, (2, 7))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=1), ids)
    lm = load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=2)
    lm.model.set_kernels(dataclasses.replace(lm.model.kernels, layer_loop="unrolled"))
    lm.model.arrange_layers()
    cfg = lm.config
    assert not lm.model.stacked and len(lm.model.layers) == cfg.num_layers
    qkv = lm.model.layers[1].self_attn.qkv_proj.weight[...]
    assert len(qkv.sharding.device_set) == 2 and qkv.addressable_shards[0].data.shape == (
        (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // 2, cfg.hidden_size)
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_tensor_parallel_mixture_of_experts_matches_single_device(tiny_model_dir):
    """Each expert's MLP split by rows like a dense MLP's (the grouped matmuls partitioned by XLA), attention by
    KV heads."""
    folder, _ = tiny_model_dir("qwen3_moe")
    ids = np.random.default_rng(2).integers(0, 1024, (2, 9))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=1), ids)
    lm = load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=2)
    gate_up = lm.model.layers.layer.mlp.experts.gate_up_proj.weight[...]  # [layers, experts, 2 * mlp, hidden]
    cfg = lm.config
    assert gate_up.addressable_shards[0].data.shape == (
        cfg.num_layers, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs --xla_force_host_platform_device_count=4")
@pytest.mark.parametrize(("case", "tp", "ep", "attn_impl"), sampled(
    [("qwen3_moe", 1, 2, "reference"), ("qwen3_moe", 1, 4, "reference"), ("qwen3_moe", 2, 2, "reference"),
     ("gpt_oss", 2, 2, "pallas_tpu")], lambda p: p[0] == "gpt_oss"))
def test_expert_parallel_matches_single_device(case, tp, ep, attn_impl, tiny_model_dir):
    """The experts split over `ep` groups of `tp` devices (each expert's rows over `tp` too), attention over `tp`.
    GPT-OSS: the experts' biases split with them, and its sinks with their heads into the Pallas kernel's
    per-device calls (interpreted here)."""
    folder, _ = tiny_model_dir(case)
    ids = np.random.default_rng(3).integers(0, 1024, (2, 9))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference"), ids)
    lm = load_model(folder, dtype="float32", attn_impl=attn_impl, tensor_parallel_size=tp, expert_parallel_size=ep)
    assert dict(lm.mesh.shape) == {"ep": ep, "tp": tp}
    cfg = lm.config
    gate_up = lm.model.layers.layer.mlp.experts.gate_up_proj.weight[...]  # [layers, experts, 2 * mlp, hidden]
    assert gate_up.addressable_shards[0].data.shape == (
        cfg.num_layers, cfg.num_experts // ep, 2 * cfg.moe_intermediate_size // tp, cfg.hidden_size)
    qkv = lm.model.layers.layer.self_attn.qkv_proj.weight[...]
    assert qkv.addressable_shards[0].data.shape[1] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
    if cfg.attention_sinks:
        sinks = lm.model.layers.layer.self_attn.sinks[...]  # [layers, heads]
        assert sinks.addressable_shards[0].data.shape == (cfg.num_layers, cfg.num_heads // tp)
        bias = lm.model.layers.layer.mlp.experts.down_proj.bias[...]  # [layers, experts, hidden]
        assert bias.addressable_shards[0].data.shape[1] == cfg.num_experts // ep
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs --xla_force_host_platform_device_count=4")
@pytest.mark.parametrize(("case", "tp", "ep"), sampled(
    [("qwen3_moe", 2, 1), ("qwen2_moe", 2, 1), ("qwen3_moe", 2, 2), ("mixtral", 2, 1)],
    lambda p: p[:2] == ("qwen2_moe", 2)))
def test_enable_expert_parallel_places_whole_experts_on_the_tensor_parallel_devices(case, tp, ep, tiny_model_dir):
    """vLLM's --enable-expert-parallel: the experts split over the tp devices themselves (over ep x tp with an ep
    axis), each expert's rows whole on its device; attention and Qwen2-MoE's shared expert split by tp as in a
    dense model."""
    folder, _ = tiny_model_dir(case)
    ids = np.random.default_rng(4).integers(0, 1024, (2, 9))
    single = _logits(load_model(folder, dtype="float32", attn_impl="reference"), ids)
    lm = load_model(folder, dtype="float32", attn_impl="reference", tensor_parallel_size=tp, expert_parallel_size=ep,
                    enable_expert_parallel=True)
    cfg = lm.config
    mlp = lm.model.layers.layer.mlp
    gate_up, down = mlp.experts.gate_up_proj.weight[...], mlp.experts.down_proj.weight[...]
    assert len(gate_up.sharding.device_set) == tp * ep
    assert gate_up.addressable_shards[0].data.shape == (  # [layers, experts, 2 * mlp, hidden]
        cfg.num_layers, cfg.num_experts // (tp * ep), 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    assert down.addressable_shards[0].data.shape == (
        cfg.num_layers, cfg.num_experts // (tp * ep), cfg.hidden_size, cfg.moe_intermediate_size)
    qkv = lm.model.layers.layer.self_attn.qkv_proj.weight[...]
    assert qkv.addressable_shards[0].data.shape[1] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim // tp
    if cfg.shared_expert_intermediate_size:
        shared = mlp.shared_expert.gate_up_proj.weight[...]  # [layers, 2 * shared, hidden]
        assert shared.addressable_shards[0].data.shape[1] == 2 * cfg.shared_expert_intermediate_size // tp
    for got, want in zip(_logits(lm, ids), single, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_enable_expert_parallel_needs_experts_the_devices_divide(tiny_model_dir):
    with pytest.raises(ConfigError, match="enable_expert_parallel needs a mixture-of-experts model"):
        load_model(tiny_model_dir("qwen2_tp")[0], dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    cfg = bundled_model_config("Qwen/Qwen3-30B-A3B")  # 128 experts
    assert logical_rules(cfg, 4, experts_over_tp=True)["expert"] == "tp"
    assert logical_rules(cfg, 4, 2, experts_over_tp=True)["expert"] == ("ep", "tp")
    odd = dataclasses.replace(cfg, moe_intermediate_size=770)  # whole experts: their width is not split
    assert logical_rules(odd, 4, experts_over_tp=True)["expert_mlp"] is None
    with pytest.raises(ConfigError, match="tensor_parallel_size=4 must divide moe_intermediate_size=770"):
        logical_rules(odd, 4)
    with pytest.raises(ConfigError, match=r"splits the experts over 4 devices, which must divide the number of "
                                          r"experts \(10\)"):
        logical_rules(dataclasses.replace(cfg, num_experts=10), 4, experts_over_tp=True)


def test_expert_parallel_needs_experts_it_divides(tiny_model_dir):
    with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
        load_model(tiny_model_dir("qwen2_tp")[0], dtype="float32", expert_parallel_size=2)
    with pytest.raises(ConfigError, match="must divide the number of experts"):
        load_model(tiny_model_dir("qwen3_moe")[0], dtype="float32", expert_parallel_size=3)


@pytest.mark.slow
@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs --xla_force_host_platform_device_count=2")
def test_an_expert_parallel_engine_generates_as_one_device(tiny_model_dir, compile_cache_dir):
    from jaxllm import LLM, SamplingParams

    folder, _ = tiny_model_dir("qwen3_moe")
    options = dict(dtype="float32", attn_impl="reference", max_num_seqs=4, max_num_batched_tokens=16, num_pages=64,
                   max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)
    prompts = [{"prompt_token_ids": np.random.default_rng(n).integers(3, 1024, n).tolist()} for n in (7, 19)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    parallel = ({}, {"expert_parallel_size": 2}, {"tensor_parallel_size": 2, "enable_expert_parallel": True})
    tokens = [[o.outputs[0].token_ids for o in LLM(str(folder), **p, **options).generate(
        prompts, params, use_tqdm=False)] for p in parallel]
    assert tokens[0] == tokens[1] == tokens[2]
