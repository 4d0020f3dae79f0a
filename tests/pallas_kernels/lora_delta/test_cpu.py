"""The CPU adapter-term kernel against its jnp reference: fused and plain layers, tokens without an adapter (exact
zeros), several tokens per slot, a slot index past the table, a layer of a stack read in place, and each token's
result independent of the others in its step (and of whether the step ran on the calling thread or the pool);
16-bit tables widened as the reference widens them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.lora_delta.cpu import applies, lora_delta
from pallas_kernels.lora_delta.reference import lora_delta as reference

L, S, IN, R = 3, 4, 48, 8


def _tables(parts, out, seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    p = 1 if parts is None else int(parts.max()) + 1
    a = rng.standard_normal((L, S, p * R, IN)).astype(np.float32)
    b = rng.standard_normal((L, S, R, out)).astype(np.float32)
    return jnp.asarray(a, dtype), jnp.asarray(b, dtype)


# gate/up's alternating parts: 80 outputs (a block the pattern does not tile), 128 (one it tiles)
@pytest.mark.parametrize("parts", [None, np.tile(np.arange(2), 40).astype(np.int32),
                                   np.tile(np.arange(2), 64).astype(np.int32),
                                   np.tile(np.r_[np.zeros(16), np.ones(8), np.full(8, 2)], 3).astype(np.int32)])
@pytest.mark.parametrize("tokens", [1, 5, 200])  # 200: both passes on the thread pool
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_kernel_equals_reference(parts, tokens, dtype):
    out = 80 if parts is None else len(parts)
    a, b = _tables(parts, out, dtype=dtype)
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, IN)).astype(np.float32))
    slots = jnp.asarray(rng.integers(-1, S, tokens).astype(np.int32).clip(-1))
    assert applies(x, a, b)  # the kernel, not the reference again
    for layer in range(L):
        f = jax.jit(lambda x, s, layer=layer: (lora_delta(x, a, b, jnp.int32(layer), s, parts),
                                                reference(x, a, b, jnp.int32(layer), s, parts)))
        got, want = f(x, slots)
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        assert not np.asarray(got)[np.asarray(slots) < 0].any()  # no adapter: exact zeros


# the second pass's three ways: rows hinted ahead on the calling thread (one token), hinted on the pool (three
# tokens of 4096 outputs), a slot's tokens in groups on the pool (the whole step); outputs whose blocks mix parts,
# alternate, or hold one part
@pytest.mark.parametrize("parts", [np.tile(np.arange(2), 40).astype(np.int32),
                                   np.tile(np.arange(2), 2048).astype(np.int32),
                                   np.tile(np.r_[np.zeros(64), np.ones(32), np.full(32, 2)], 3).astype(np.int32),
                                   None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_tokens_result_does_not_depend_on_its_step(parts, dtype):
    out = 4096 if parts is None else len(parts)
    a, b = _tables(parts, out, seed=3, dtype=dtype)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((200, IN)).astype(np.float32)
    slots = np.array([2, -1, 7, 0] * 50, np.int32)  # 7: past the table, as none
    f = jax.jit(lambda x, s: lora_delta(x, a, b, jnp.int32(1), s, parts))
    whole = np.asarray(f(jnp.asarray(x), jnp.asarray(slots)))
    assert not whole[2].any() and whole[0].any()
    for t0, t1 in ((0, 1), (5, 6), (30, 31), (199, 200), (3, 6), (28, 31)):
        alone = np.asarray(f(jnp.asarray(x[t0:t1]), jnp.asarray(slots[t0:t1])))
        np.testing.assert_array_equal(alone, whole[t0:t1])


# a slot's tokens four at a time (`GROUP`) in both passes, with the ragged ends of every loop: 50 inputs (3 vectors
# and 2 left over), 83 outputs (64 in registers, 16, then 3 one by one), runs of one slot and slots in turn
@pytest.mark.parametrize("parts", [None, np.tile(np.arange(2), 42)[:83].astype(np.int32)], ids=["one", "gate_up"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_slots_tokens_grouped_give_each_tokens_bits_alone(parts, dtype):
    rng = np.random.default_rng(5)
    p = 1 if parts is None else 2
    a = jnp.asarray(rng.standard_normal((L, S, p * R, 50)).astype(np.float32), dtype)
    b = jnp.asarray(rng.standard_normal((L, S, R, 83)).astype(np.float32), dtype)
    x = rng.standard_normal((40, 50)).astype(np.float32)
    slots = np.r_[np.full(13, 1), np.arange(27) % S].astype(np.int32)
    f = jax.jit(lambda x, s: lora_delta(x, a, b, jnp.int32(2), s, parts))
    whole = np.asarray(f(jnp.asarray(x), jnp.asarray(slots)))
    for t in range(40):
        np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[t:t + 1]), jnp.asarray(slots[t:t + 1])))[0],
                                      whole[t])
    want = reference(jnp.asarray(x), a, b, jnp.int32(2), jnp.asarray(slots), parts)
    np.testing.assert_allclose(whole, want, rtol=2e-5, atol=2e-5)
