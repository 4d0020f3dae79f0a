"""A model family is one spec: a test-only family (`windowed_gelu_family`: GeGLU, windows on alternate layers)
loads from its own config, runs through the engine's paged step under the layer scan (the windows then are
runtime values in the kernels) and matches transformers' logits."""

import json

import numpy as np
import pytest

from jaxllm.loading import load_model
from jaxllm.models import registry
from tests.models import windowed_gelu_family as family
from tests.models.test_hf_parity import _hf_logits
from tests.paged_driver import PagedRunner

LENGTHS = [13, 6, 11]  # past the window of 4, in one ragged batch


@pytest.fixture(scope="module", autouse=True)
def the_family():
    with registry.registered(family.SPEC):
        yield


@pytest.fixture(scope="module")
def windowed_folder(tmp_path_factory):
    import torch
    import transformers

    from tests.tiny_models import COMMON

    torch.manual_seed(7)
    config = transformers.Qwen2Config(**{**COMMON, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=4,
                                      layer_types=["sliding_attention", "full_attention"] * 2,
                                      hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("windowed_gelu")
    model.save_pretrained(folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "architectures": [family.ARCHITECTURE]}))
    return folder, model


def _sequences(vocab):
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, n).tolist() for n in LENGTHS]


def test_the_family_is_its_spec(windowed_folder):
    folder, _ = windowed_folder
    assert registry.architecture_spec(family.ARCHITECTURE) is family.SPEC
    cfg = load_model(folder, dtype="float32", attn_impl="reference").config
    assert cfg.layer_windows == (4, 0, 4, 0) and cfg.activation == "gelu_tanh" and cfg.sliding_window is None
    assert cfg.attention_bias and not cfg.o_bias


@pytest.mark.parametrize("attn_impl", ["reference", "cpu"])
def test_paged_steps_under_the_layer_scan_match_transformers(windowed_folder, attn_impl):
    folder, hf_model = windowed_folder
    lm = load_model(folder, dtype="float32", attn_impl=attn_impl)
    assert lm.model.stacked  # the layers run in a scan: each layer's window is a traced value
    seqs = _sequences(lm.config.vocab_size)
    expected = _hf_logits(hf_model, seqs)
    runner = PagedRunner(lm.model, num_pages=16, page_size=4)
    got = {i: [] for i in range(len(seqs))}
    done = dict.fromkeys(range(len(seqs)), 0)
    while any(done[i] < len(s) for i, s in enumerate(seqs)):  # chunks of 5, then whatever is left
        chunk = {i: s[done[i]:done[i] + 5] for i, s in enumerate(seqs) if done[i] < len(s)}
        for i, logits in runner.step(chunk, all_logits=True).items():
            got[i].append(logits)
            done[i] += len(chunk[i])
    for i in got:
        np.testing.assert_allclose(np.concatenate(got[i]), expected[i], atol=1e-4, rtol=0)


def test_the_dense_path_matches_transformers_and_the_windows_matter(windowed_folder):
    import dataclasses

    import jax.numpy as jnp

    folder, hf_model = windowed_folder
    lm = load_model(folder, dtype="float32", attn_impl="reference")
    seqs = _sequences(lm.config.vocab_size)[:1]
    want = _hf_logits(hf_model, seqs)[0]
    got = np.asarray(lm.model(jnp.asarray(seqs)))[0]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    lm.model.config = dataclasses.replace(lm.config, layer_windows=None)  # the same weights, every layer whole
    whole = np.asarray(lm.model(jnp.asarray(seqs)))[0]
    np.testing.assert_allclose(whole[:4], want[:4], atol=1e-4, rtol=0)  # within the window: the same
    assert np.abs(whole[4:] - want[4:]).max() > 1e-2  # past it: the windows changed the numbers


def test_a_family_builds_its_layers_from_its_factories():
    from flax import nnx

    from jaxllm.config import ModelConfig
    from jaxllm.models.family import FamilySpec
    from jaxllm.models.llama import MLP, LlamaForCausalLM

    class ScaledMLP(MLP):  # e.g. a mixture of experts would stand here
        def __call__(self, x):
            return 2 * super().__call__(x)

    with registry.registered(FamilySpec("JaxllmScaledMlpForCausalLM", mlp=ScaledMLP)):
        cfg = ModelConfig("JaxllmScaledMlpForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
        model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0), attn_impl="reference")
    assert all(type(layer.mlp) is ScaledMLP for layer in model.layers)
    x = np.ones((1, 3, 32), np.float32)
    np.testing.assert_allclose(model.layers[0].mlp(x), 2 * MLP.__call__(model.layers[0].mlp, x), rtol=1e-6)
