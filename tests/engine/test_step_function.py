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
def test_the_head_computes_the_rows_in_use(quantization, tiny_model_dir):
    lm = load_model(tiny_model_dir("llama")[0], dtype="float32", quantization=quantization)
    model = lm.model
    assert model.kernels.platform == "cpu"
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((96, model.config.hidden_size)), jnp.float32)
    rows = jnp.asarray(np.random.default_rng(1).permutation(96)[:64], jnp.int32)  # N = 64 sample rows
    every = np.asarray(model.logits(hidden[rows]))
    head = jax.jit(lambda live: step_function._head(model, hidden, rows, live))
    for live, computed in ((1, 1), (5, 8), (8, 8), (9, 32), (33, 64), (64, 64)):
        got = np.asarray(head(jnp.int32(live)))
        if quantization == "int8":
            np.testing.assert_array_equal(got[:computed], every[:computed])  # bit for bit
        else:
            np.testing.assert_allclose(got[:computed], every[:computed], rtol=0, atol=1e-5)
        assert not got[computed:].any()  # the tier's rows only
