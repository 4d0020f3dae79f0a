"""The embedded SmolLM2 with the CPU quantized matmul on int8 activations (the host's widest integer path), against
the same model on float activations: the numbers differ (the path really ran), by little (perplexity on the
committed text within 2%, the same next token almost everywhere)."""

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.loading import load_model
from pallas_kernels.quantized_matmul import isa

TEXT = Path(__file__).parents[2] / "benchmarks" / "data" / "perplexity.txt"


def _nll(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    logits = logits[:-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[:, 0]
    return logz - logits[np.arange(len(ids) - 1), ids[1:]]


@pytest.mark.slow
def test_int8_activations_stay_close_to_float(monkeypatch):
    if not isa.available():
        pytest.skip(f"no integer path on this CPU ({isa.describe()})")
    runs = {}
    for path in ("none", isa.available()[0]):
        monkeypatch.setenv(isa.ENV, path)
        loaded = load_model(None, dtype="float32", attn_impl="reference")
        assert loaded.model.kernels.int8_isa == (None if path == "none" else path)
        ids = loaded.tokenizer.encode(TEXT.read_text()[:2400])[:384]
        runs[path] = np.asarray(loaded.model(jnp.asarray([ids])))[0]
    float_logits, int8_logits = runs.values()
    assert np.max(np.abs(int8_logits - float_logits)) > 1e-3  # int8 activations ran
    ppl_float, ppl_int8 = (float(np.exp(_nll(v, ids).mean())) for v in (float_logits, int8_logits))
    assert abs(ppl_int8 / ppl_float - 1) < 0.02, (ppl_float, ppl_int8)
    agree = np.mean(int8_logits.argmax(-1) == float_logits.argmax(-1))
    assert agree > 0.9, agree
