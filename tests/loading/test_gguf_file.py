"""GGUF reading on tiny files written like llama.cpp's converter: q/k un-permutation, every supported
quantization type, and errors."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from jaxllm.loading import LoadError, load_model
from jaxllm.loading.gguf_file import GGUFFile
from tests.gguf_writer import write_llama_gguf


def test_f32_gguf_matches_transformers(tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir("llama")
    path = write_llama_gguf(hf_model, tmp_path / "tiny.gguf")
    lm = load_model(path, dtype="float32", attn_impl="reference")
    ids = np.random.default_rng(0).integers(0, 1024, (1, 12))
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray(ids))), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("qtype", [T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K])
def test_every_supported_type_reads_like_gguf_reader(qtype, tiny_model_dir, tmp_path):
    _, hf_model = tiny_model_dir("llama")
    rng = np.random.default_rng(0)
    if qtype in (T.Q4_K, T.Q6_K):  # gguf-py cannot quantize these: random blocks with sane f16 scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (8, 512 // block * size), dtype=np.uint8)
        scale_at = [0, 2] if qtype == T.Q4_K else [size - 2]
        for off in scale_at:
            for b in range(512 // block):
                raw[:, b * size + off:b * size + off + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    else:
        raw = quants.quantize(rng.standard_normal((8, 512)).astype(np.float32), qtype)
    path = write_llama_gguf(hf_model, tmp_path / "q.gguf", T.F16, extra_tensors={"probe.weight": (raw, qtype)})
    reader = gguf.GGUFReader(path)
    ref = next(t for t in reader.tensors if t.name == "probe.weight")
    expected = quants.dequantize(ref.data, qtype)
    got = GGUFFile(path).load("probe.weight")
    assert got.shape == (8, 512)
    np.testing.assert_array_equal(np.asarray(got, np.float32), expected.reshape(8, 512))
    assert np.isfinite(expected).all() and np.abs(expected).max() > 0


def test_quantized_model_still_close_to_transformers(tiny_model_dir, tmp_path):
    import torch

    _, hf_model = tiny_model_dir("llama")
    lm = load_model(write_llama_gguf(hf_model, tmp_path / "q8.gguf", T.Q8_0), dtype="float32")
    ids = np.arange(10)[None]
    with torch.no_grad():
        expected = hf_model(torch.tensor(ids)).logits.numpy()
    got = np.asarray(lm.model(jnp.asarray(ids)))
    assert np.abs(got - expected).max() < 0.05 * np.abs(expected).max()


def test_unsupported_quantization_type_is_named(tiny_model_dir, tmp_path):
    _, hf_model = tiny_model_dir("llama")
    raw = quants.quantize(np.ones((4, 64), np.float32), T.Q5_0)
    path = write_llama_gguf(hf_model, tmp_path / "q5.gguf", extra_tensors={"probe.weight": (raw, T.Q5_0)})
    with pytest.raises(LoadError, match=r"q5\.gguf: tensor 'probe.weight' uses quantization type Q5_0, which is "
                                        r"not supported"):
        GGUFFile(path).load("probe.weight")


def test_truncated_and_bogus_gguf(tiny_model_dir, tmp_path):
    _, hf_model = tiny_model_dir("llama")
    data = write_llama_gguf(hf_model, tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(LoadError, match=r"cut\.gguf: tensor .* runs past the end of the file"):
        load_model(tmp_path / "cut.gguf")
    (tmp_path / "header.gguf").write_bytes(data[:200])
    with pytest.raises(LoadError, match=r"header\.gguf: corrupt or truncated GGUF header"):
        load_model(tmp_path / "header.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(LoadError, match=r"junk\.gguf: not a GGUF file"):
        load_model(tmp_path / "junk.gguf")
