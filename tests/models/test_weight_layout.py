"""The engine's weight layout step (`jaxllm.models.weight_layout`) on the embedded SmolLM2: where the host's int8
path reads interleaved weights, every quantized linear layer and the tied table are interleaved, the logits stay
those of int8 activations (close to the plain layout's, bit-identical to the amx path's where this CPU runs it),
and a checkpoint of the interleaved model is refused."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm.loading import load_model
from jaxllm.loading.checkpoint import save_checkpoint
from jaxllm.models.layers import Embed, Linear
from jaxllm.models.weight_layout import has_interleaved, interleave_weights, wants_interleaved
from pallas_kernels.quantized_matmul import cpu, isa


def _logits(model, ids):
    return np.asarray(model(jnp.asarray([ids])))[0]


def test_interleaved_weights_keep_the_model(monkeypatch, tmp_path):
    path = next((p for p in cpu.X16_ISAS if isa.supported(p)), None)
    if path is None:
        pytest.skip(f"no path with interleaved loops on this CPU ({isa.describe()})")
    monkeypatch.setenv(isa.ENV, path)
    loaded = load_model(None, dtype="float32", attn_impl="reference")
    model = loaded.model
    assert wants_interleaved(model) and not has_interleaved(model)
    ids = loaded.tokenizer.encode("The capital of France is Paris. The capital of Italy is")[:16]
    plain = _logits(model, ids)
    assert interleave_weights(model) > 0 and has_interleaved(model)
    quantized = [m for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, Embed)) and m.quant is not None]
    assert quantized and all(m.quant.interleaved for m in quantized)
    assert interleave_weights(model) == 0  # once
    x16 = _logits(model, ids)
    assert not np.array_equal(x16, plain)  # the interleaved loops ran (their rounding differs from the lanes')
    np.testing.assert_allclose(x16, plain, atol=0.05 * np.abs(plain).max())
    assert np.array_equal(x16.argmax(-1), plain.argmax(-1))
    with pytest.raises(ValueError, match="interleaved"):
        save_checkpoint(model, tmp_path / "ckpt")
    if isa.supported("amx"):
        monkeypatch.setenv(isa.ENV, "amx")
        amx = load_model(None, dtype="float32", attn_impl="reference").model
        assert not wants_interleaved(amx)
        np.testing.assert_array_equal(_logits(amx, ids), x16)
