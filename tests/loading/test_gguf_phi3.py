"""Phi-3 GGUF files as llama.cpp's converter writes them (stacked `attn_qkv` and `ffn_up`, the rotary dimensions
and the sliding window in the metadata): float32 logits equal transformers'; Q8_0 kept quantized; LongRoPE's
factor tensors (the 128k variants) run as transformers runs them. (llama.cpp's llama-bench ran the Q8_0 file
written with `spm_vocab=True`: checked by hand, the suite does not build llama.cpp.)"""

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from jaxllm import LLM, SamplingParams
from jaxllm.loading import LoadError, load_model
from tests.gguf_writer import write_phi3_gguf

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]  # a GGUF family's engines


def test_f32_phi3_gguf_matches_transformers(tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir("phi3")
    lm = load_model(write_phi3_gguf(hf_model, tmp_path / "phi3.gguf"), dtype="float32", attn_impl="reference")
    assert (lm.config.rope.partial_rotary_factor, lm.config.sliding_window) == (0.5, 6)
    ids = np.random.default_rng(0).integers(3, 1024, (1, 14))  # longer than the window
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray(ids))), expected, atol=1e-4, rtol=0)


def test_q8_0_phi3_gguf_kept_quantized(tiny_model_dir, tmp_path):
    """Served as its own Q8_0 blocks: logits within Q8_0's rounding of transformers' (weights of std 0.08: errors
    ~0.05 on logits of ~2), and the engine's greedy tokens those of the same file dequantized to float32."""
    import torch

    _, hf_model = tiny_model_dir("phi3")
    path = write_phi3_gguf(hf_model, tmp_path / "phi3-q8_0.gguf", T.Q8_0, spm_vocab=True)  # as real files are
    lm = load_model(path, dtype="float32", attn_impl="reference")
    assert dict(lm.model.quantization)["qkv_proj"].name == "q8_0"  # the stacked tensor split as blocks
    ids = np.random.default_rng(5).integers(3, 1024, (1, 14))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray(ids))), expected, atol=0.15, rtol=0)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": rng.integers(3, 1024, n).tolist()} for n in (8, 13)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = []
    for quantization in ("auto", "none"):
        llm = LLM(str(path), quantization=quantization, max_num_seqs=4, max_num_batched_tokens=16, num_pages=64,
                  max_model_len=64, page_size=4)
        tokens.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_a_longrope_phi3_gguf_runs_the_factor_set_of_its_context(tiny_model_dir, tmp_path):
    """Phi-3 128k's LongRoPE from its GGUF (the factor tensors, the original length and the attention factor): the
    short factors within the original length, the long ones for a longer context, each equal to transformers'
    logits where transformers runs the same set; a file with one factor set only is refused."""
    import gguf

    from tests.models.test_hf_parity import _hf_logits

    _, hf_model = tiny_model_dir("phi3_longrope")
    path = write_phi3_gguf(hf_model, tmp_path / "phi3-128k.gguf")
    lm = load_model(path, dtype="float32", attn_impl="reference")
    rope = lm.config.rope
    assert (rope.rope_type, rope.factor, rope.original_max_position_embeddings, rope.long_context) == (
        "longrope", 8.0, 32, False)
    assert rope.attention_factor == pytest.approx(np.sqrt(1 + np.log(8) / np.log(32)))
    rng = np.random.default_rng(0)
    short, long = (rng.integers(3, 1024, n).tolist() for n in (20, 40))
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray([short])))[0], _hf_logits(hf_model, [short])[0],
                               atol=1e-4, rtol=0)
    lm.model.set_context_length(256)
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray([long])))[0], _hf_logits(hf_model, [long])[0],
                               atol=1e-4, rtol=0)

    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "one-set.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith(("phi3.", "tokenizer.")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name != "rope_factors_short.weight":
            writer.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match=r"LongRoPE needs both factor tensors; 'rope_factors_short.weight' is missing"):
        load_model(tmp_path / "one-set.gguf", dtype="float32")
