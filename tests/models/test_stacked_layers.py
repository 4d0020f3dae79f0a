"""The scanned decoder (`StackedLayers`): the same outputs and KV cache as the unrolled layers, a round trip back
to separate layers, a model whose layers differ stays unrolled and runs, and a step's program does not grow with
depth (the layer is traced once)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.config import ModelConfig
from jaxllm.kernels import attention_kernel, choose_kernels
from jaxllm.models.layers import Linear
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.models.stacked_layers import LAYERS_AXIS, StackedLayers
from tests.matrix import sampled
from tests.paged_driver import PagedRunner, greedy_generate

CFG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=True)


def _model(cfg=CFG, **kw) -> LlamaForCausalLM:
    return LlamaForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0), **kw)  # the same weights every time


@pytest.mark.parametrize("attn_impl", sampled(["cpu", "reference"], lambda a: a == "cpu"))
def test_stacked_layers_give_the_unrolled_outputs_and_cache(attn_impl):
    unrolled, stacked = _model(attn_impl=attn_impl), _model(attn_impl=attn_impl)
    assert stacked.stack_layers() and isinstance(stacked.layers, StackedLayers) and not unrolled.stacked
    ids = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(stacked(ids)), np.asarray(unrolled(ids)), rtol=1e-5, atol=1e-5)

    runners = [PagedRunner(m, num_pages=12, page_size=4) for m in (unrolled, stacked)]
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    outs = [greedy_generate(r, prompts, 6) for r in runners]
    assert outs[0] == outs[1]
    for a, b in zip(*(r.caches for r in runners), strict=True):  # each layer wrote its own range of pages
        assert a.shape == (CFG.num_kv_heads, CFG.num_layers * 12, 4, CFG.head_dim)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        per_layer = np.asarray(a).reshape(CFG.num_kv_heads, CFG.num_layers, 12, 4, CFG.head_dim)
        assert all(np.any(per_layer[:, layer]) for layer in range(CFG.num_layers))


@pytest.mark.parametrize(("attn_impl", "matmul_impl"), sampled([("cpu", "cpu"), ("reference", "reference")],
                                                            lambda p: p == ("cpu", "cpu")))
def test_stacked_layers_unrolled_give_the_scanned_outputs_and_cache(attn_impl, matmul_impl):
    """The GPU's layer loop (`Kernels.layer_loop`: static slices of the stacks, no scan), run here on CPU."""
    scanned = _model(attn_impl=attn_impl, matmul_impl=matmul_impl)
    unrolled = _model(kernels=choose_kernels(attn_impl, matmul_impl, layer_loop="unrolled"))
    assert scanned.stack_layers() and unrolled.stack_layers()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(unrolled(ids)), np.asarray(scanned(ids)), rtol=1e-5, atol=1e-5)
    graphdef, state = nnx.split(unrolled)
    hlo = jax.jit(lambda s, i: nnx.merge(graphdef, s)(i)).lower(state, ids).as_text()
    assert "stablehlo.while" not in hlo and "dynamic_slice" not in hlo  # each layer a static slice of the stacks
    runners = [PagedRunner(m, num_pages=12, page_size=4) for m in (scanned, unrolled)]
    prompts = [[5, 6, 7, 8, 9], [11, 12]]
    assert greedy_generate(runners[0], prompts, 6) == greedy_generate(runners[1], prompts, 6)
    for a, b in zip(*(r.caches for r in runners), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_unstacking_gives_back_the_layers():
    original, model = _model(), _model()
    model.stack_layers()
    w = model.layers.layer.mlp.gate_up_proj.weight
    assert w[...].shape == (CFG.num_layers, 2 * CFG.intermediate_size, CFG.hidden_size)
    assert w.get_metadata()["axes"] == (LAYERS_AXIS, "mlp", "embed")  # the layer axis is never sharded
    with pytest.raises(TypeError, match=r"call model.unstack_layers\(\)"):
        model.layers[1]  # noqa: B018
    model.unstack_layers()
    assert not model.stacked and len(model.layers) == CFG.num_layers
    for got, want in zip(nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(original)), strict=True):
        assert got[0] == want[0]
        assert got[1].get_metadata()["axes"] == want[1].get_metadata()["axes"]
        assert np.array_equal(np.asarray(got[1].get_value()), np.asarray(want[1].get_value()))


def test_a_model_whose_layers_differ_stays_unrolled_and_runs():
    """A notebook gives one layer a bias its siblings lack: stacking is refused, and the model still runs."""
    model = _model(CFG)
    model.layers[1].mlp.down_proj = Linear(CFG.intermediate_size, CFG.hidden_size, ("mlp", "embed"), bias=True,
                                           rngs=nnx.Rngs(1))
    assert not model.stack_layers() and isinstance(model.layers, nnx.List)
    ids = jnp.asarray([[3, 4, 5, 6]], jnp.int32)
    dense = np.asarray(model(ids))
    paged = PagedRunner(model, num_pages=8, page_size=4).step({0: [3, 4, 5, 6]}, all_logits=True)[0]
    np.testing.assert_allclose(paged, dense[0], rtol=1e-4, atol=1e-4)


def _step_program(num_layers: int, stacked: bool) -> str:
    cfg = dataclasses.replace(CFG, num_layers=num_layers)
    model = _model(cfg, attn_impl="reference")
    if stacked:
        model.stack_layers()
    runner = PagedRunner(model, num_pages=8, page_size=4)
    meta = AttentionMetadata.build(query_lens=[3], context_lens=[3], block_tables=[[0]], page_size=4,
                                   max_pages_per_seq=8)
    graphdef = runner.graphdef

    def forward(state, caches, ids, positions, meta):
        return nnx.merge(graphdef, state).forward_paged(ids, positions, caches, meta)

    ids = jnp.zeros(3, jnp.int32)
    return jax.jit(forward).lower(runner.state, runner.caches, ids, ids, meta).as_text()


def test_the_scanned_step_does_not_grow_with_depth():
    shallow, deep = len(_step_program(2, True)), len(_step_program(12, True))
    assert deep < 1.05 * shallow  # the layer is in the program once, whatever the depth
    assert len(_step_program(12, False)) > 3 * len(_step_program(2, False))  # unrolled: once per layer


def test_the_layout_follows_the_layer_loop():
    """`arrange_layers`: a scan keeps the layers stacked; an unrolled loop (the GPU's) gets separate layers, each
    stacked array deleted once its layers exist, and the same outputs."""
    scanned = _model(attn_impl="reference", matmul_impl="reference")
    unrolled = _model(kernels=choose_kernels("reference", "reference", layer_loop="unrolled"))
    scanned.arrange_layers()
    assert scanned.stacked
    unrolled.stack_layers()  # as the loaders return it
    stacks = jax.tree.leaves(nnx.state(unrolled.layers))
    unrolled.arrange_layers()
    assert not unrolled.stacked and len(unrolled.layers) == CFG.num_layers
    assert stacks and all(x.is_deleted() for x in stacks)
    assert len(jax.tree.leaves(nnx.state(unrolled.layers))) == CFG.num_layers * len(stacks)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, CFG.vocab_size, (2, 7)), jnp.int32)
    np.testing.assert_allclose(np.asarray(unrolled(ids)), np.asarray(scanned(ids)), rtol=1e-5, atol=1e-5)
    unrolled.arrange_layers()  # already laid out: nothing moves
    assert not unrolled.stacked


@pytest.mark.slow
def test_the_engine_lays_out_a_model_it_is_given():
    from jaxllm import LLM, SamplingParams

    model = _model(kernels=choose_kernels("reference", "reference", layer_loop="unrolled"))
    model.stack_layers()
    llm = LLM(model=model, num_pages=16, max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16)
    assert llm.engine.model is model and not model.stacked
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=4,
                                                                             ignore_eos=True), use_tqdm=False)
    scanned = _model(attn_impl="reference", matmul_impl="reference")
    scanned.stack_layers()
    want = greedy_generate(PagedRunner(scanned, num_pages=12, page_size=4), [[5, 6, 7, 8]], 4)
    assert [out[0].outputs[0].token_ids] == want


def test_captured_layer_inputs_are_the_residual_stream_scanned_or_unrolled():
    """forward_paged(capture=...) returns each captured layer's input (what an EAGLE-3 head reads) side by side, the
    same whether the layers are scanned, unrolled over static slices (GPU) or separate modules, and the hidden
    states and cache are those of a forward without capture."""
    scanned, sliced, separate = _model(), _model(kernels=choose_kernels(layer_loop="unrolled")), _model()
    assert scanned.stack_layers() and sliced.stack_layers() and not separate.stacked
    ids = jnp.asarray([5, 6, 7, 8, 9, 11, 12, 0], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 3, 4, 0, 1, 0], jnp.int32)
    meta = AttentionMetadata.build(query_lens=[5, 2], context_lens=[5, 2], block_tables=[[1, 2], [3]], page_size=4,
                                   num_tokens=8, num_seqs=2, max_pages_per_seq=2)

    def caches():
        shape = (CFG.num_kv_heads, CFG.num_layers * 8, 4, CFG.head_dim)
        return jnp.zeros(shape), jnp.zeros(shape)

    # the residual stream entering layers 0 and 2: the embeddings, and the output of layer 1
    plain_hidden, plain_cache = separate.forward_paged(ids, positions, caches(), meta)
    x = separate.embed(ids)
    inputs = [x]
    for index, layer in enumerate(separate.layers):
        meta_l = meta.offset_pages(index * 8, 4)
        cos, sin = separate._rope(positions)
        x, _ = layer(x, lambda attn, h, m=meta_l, c=cos, s=sin: attn.paged(h, c, s, caches(), m, attention_kernel(
            separate.kernels), None))
        inputs.append(x)
    want = np.concatenate([inputs[0], inputs[2]], axis=-1)
    for model in (scanned, sliced, separate):
        hidden, cache, features = model.forward_paged(ids, positions, caches(), meta, capture=(0, 2))
        assert features.shape == (8, 2 * CFG.hidden_size)
        np.testing.assert_allclose(np.asarray(features)[:7], want[:7], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(hidden), np.asarray(plain_hidden), rtol=1e-5, atol=1e-5)
        for a, b in zip(cache, plain_cache, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
