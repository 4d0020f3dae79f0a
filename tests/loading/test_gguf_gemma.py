"""Gemma 2 and 3 GGUF files as llama.cpp's converter writes them (norms stored as 1 + w, sandwich norms under their
own names, soft caps, window and windowed layers' RoPE in the metadata): float32 logits equal transformers'
(scaled by head_dim, as llama.cpp scales: its files carry no `query_pre_attn_scalar`), and a Q8_0 file is served
from its own blocks with the greedy tokens of the same file dequantized."""

import copy

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxllm import LLM
from jaxllm.loading import load_model
from tests.gguf_writer import write_gemma_gguf
from tests.quantized_greedy import assert_greedy_within

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # a GGUF family's engines


def _scaled_by_head_dim(hf_model):
    """transformers' model with llama.cpp's attention scale (head_dim ** -0.5) in place of query_pre_attn_scalar's."""
    model = copy.deepcopy(hf_model)
    for layer in model.model.layers:
        layer.self_attn.scaling = model.config.head_dim ** -0.5
    return model


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_f32_gemma_gguf_matches_transformers(case, tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir(case)
    lm = load_model(write_gemma_gguf(hf_model, tmp_path / f"{case}.gguf"), dtype="float32", attn_impl="reference")
    assert lm.config.layer_windows == tuple(6 if k == "sliding_attention" else 0 for k in hf_model.config.layer_types)
    assert lm.config.attn_scale == 16 ** -0.5 and lm.config.rms_norm_offset == 0.0
    ids = np.random.default_rng(0).integers(3, 1024, (1, 14))  # longer than the window
    with torch.no_grad():
        expected = _scaled_by_head_dim(hf_model)(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray(ids))), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["gemma2", "gemma3"])
def test_q8_0_gemma_gguf_kept_quantized_greedy_within_quantization(case, tiny_model_dir, tmp_path):
    """Every greedy token of the Q8_0 file served from its blocks is transformers' top token after the same prefix,
    or within Q8_0's rounding of it (0.1 below the top logit: weights of std 0.08 give errors ~0.05 on logits)."""
    _, hf_model = tiny_model_dir(case)
    reference = _scaled_by_head_dim(hf_model)
    path = write_gemma_gguf(hf_model, tmp_path / f"{case}-q8_0.gguf", T.Q8_0)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16, num_pages=64, max_model_len=64, page_size=4)
    assert dict(llm.engine.model.quantization)["qkv_proj"].name == "q8_0"
    rng = np.random.default_rng(5)
    assert_greedy_within(llm, reference, [rng.integers(3, 1024, n).tolist() for n in (8, 13, 21)])
