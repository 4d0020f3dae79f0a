"""The step function's LM head on CPU runs on the rows in use only (`step_function._head`): the first tier of
rows that holds them, the rest zeros. With quantized weights each computed row's logits are the bits of the head
on every row (the kernel's rows are independent); float32 weights take the skinny kernel up to 32 rows and XLA's
dot above, which round differently in the last bits (as between buckets before)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.engine import step_function
from jaxllm.loading import load_model


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_the_head_and_sampler_compute_the_rows_in_use(quantization, tiny_model_dir):
    """A step's N sample rows are computed (logits and sampling) for the first tier that holds the live ones: their
    tokens, logprobs and top-k are those of all N rows computed (seeded sampling, penalties on a history), the
    rows past the tier zeros."""
    from tests.engine.test_sampler import tensors

    lm = load_model(tiny_model_dir("llama")[0], dtype="float32", quantization=quantization)
    model = lm.model
    assert model.kernels.platform == "cpu"
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((96, model.config.hidden_size)), jnp.float32)
    rows = jnp.asarray(np.random.default_rng(1).permutation(96)[:64], jnp.int32)  # N = 64 sample rows
    history = np.random.default_rng(2).integers(-1, model.config.vocab_size, (64, 6))
    sampling = tensors(64, temperature=0.7, top_k=20, rep=1.3, seeds=np.arange(64) * 7919, history=history)
    every = jax.jit(lambda: step_function._sample_rows(model, hidden, rows, sampling, jnp.int32(64)))()[1]
    head = jax.jit(lambda live: step_function._sample_rows(model, hidden, rows, sampling, live))
    for live, computed in ((1, 1), (5, 8), (8, 8), (9, 32), (33, 64), (64, 64)):
        tokens, packed = (np.asarray(a) for a in head(jnp.int32(live)))
        if quantization == "int8":
            np.testing.assert_array_equal(packed[:computed], np.asarray(every)[:computed])  # bit for bit
        else:  # the token ids and ranks exactly, the logprobs' bits up to XLA's rounding of the shorter head
            np.testing.assert_array_equal(packed[:computed, [0, 2]], np.asarray(every)[:computed, [0, 2]])
        np.testing.assert_array_equal(tokens, packed[:, 0])
        assert not packed[computed:].any()  # the tier's rows only
