"""Phi-3 GGUF files as llama.cpp's converter writes them (stacked `attn_qkv` and `ffn_up`, the rotary dimensions
and the sliding window in the metadata): float32 logits equal transformers'; Q8_0 kept quantized; LongRoPE's
factor tensors refused. (llama.cpp's llama-bench ran the Q8_0 file written with `spm_vocab=True`: checked by hand,
the suite does not build llama.cpp.)"""

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


def test_longrope_factors_in_a_phi3_gguf_are_refused(tiny_model_dir, tmp_path):
    import gguf

    _, hf_model = tiny_model_dir("phi3")
    path = write_phi3_gguf(hf_model, tmp_path / "phi3.gguf")
    reader = gguf.GGUFReader(str(path))
    assert any(t.name == "blk.0.attn_qkv.weight" for t in reader.tensors)
    writer = gguf.GGUFWriter(str(tmp_path / "longrope.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith(("phi3.", "tokenizer.")):
            writer.add_key_value(field.name, field.contents(), field.types[0],
                                 field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))))
    writer.add_tensor("rope_factors_long.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match=r"unexpected tensor 'rope_factors_long.weight'"):
        load_model(tmp_path / "longrope.gguf", dtype="float32")
