"""The numba CPU kernel, directly (every work item on the calling thread) and through its XLA FFI custom call
(cache write + attention, work items shared with XLA's thread pool), against a naive dense attention."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import attention_kernel, choose_kernels
from pallas_kernels.cpu_ffi import busy_slots
from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.cpu_kernel import attend_serial
from tests.pallas_kernels.ragged_paged_attention.cases import KINDS, make_case
from tests.pallas_kernels.ragged_paged_attention.test_reference import naive_attention

OPTIONS = [{}, {"sliding_window": 9}, {"soft_cap": 5.0}]
OPTION_IDS = ["plain", "window", "softcap"]


def _direct(case, block_q, min_items, sliding_window=None, soft_cap=None):
    m = case.meta
    q = np.asarray(case.q)
    out = np.full_like(q, np.nan)  # every element must be written, padding rows included
    attend_serial(q, np.asarray(case.k_cache), np.asarray(case.v_cache), np.asarray(m.kv_lens),
           np.asarray(m.block_tables), np.asarray(m.query_start_loc), out, np.float32(q.shape[-1] ** -0.5),
           sliding_window or 0, np.float32(soft_cap or 0.0), block_q, min_items)
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("block_q", [1, 4])
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
@pytest.mark.parametrize("split", [False, True], ids=["items", "split-by-head"])
def test_kernel_matches_naive_dense(kind, block_q, options, split):
    case = make_case(kind, num_heads=6, num_kv_heads=2, head_dim=32, page_size=8, dtype=np.float32)
    got = _direct(case, block_q, 1 << 30 if split else 0, **options)
    np.testing.assert_allclose(got, naive_attention(case, **options), atol=1e-5, rtol=1e-5)
    assert np.all(got[case.num_real_tokens:] == 0)


def _step(impl, case, **options):
    """Writes fresh K/V for the step's tokens, then attends: -> (out, k_cache, v_cache) and the case with the
    expected caches (the new K/V written in numpy)."""
    m = case.meta
    t, kvh, d = case.q.shape[0], case.k_cache.shape[0], case.q.shape[-1]
    rng = np.random.default_rng(7)
    k_new, v_new = (rng.standard_normal((t, kvh, d)).astype(np.float32) for _ in range(2))
    expected_k, expected_v = np.array(case.k_cache), np.array(case.v_cache)
    page_size = expected_k.shape[2]
    for tok, slot in enumerate(np.asarray(m.slot_mapping)):
        if slot >= 0:
            expected_k[:, slot // page_size, slot % page_size] = k_new[tok]
            expected_v[:, slot // page_size, slot % page_size] = v_new[tok]
    kernel = attention_kernel(choose_kernels(impl, platform="cpu"))
    step = jax.jit(functools.partial(kernel, sm_scale=d ** -0.5, **options), donate_argnums=(3, 4))
    got = step(case.q, jnp.asarray(k_new), jnp.asarray(v_new), jnp.array(case.k_cache), jnp.array(case.v_cache),
               m.slot_mapping, m.kv_lens, m.block_tables, m.query_start_loc)
    expected_case = dataclasses.replace(case, k_cache=jnp.asarray(expected_k), v_cache=jnp.asarray(expected_v))
    return [np.asarray(x) for x in got], expected_case


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("options", OPTIONS, ids=OPTION_IDS)
def test_custom_call_writes_the_cache_then_attends(kind, options):
    case = make_case(kind, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float32)
    (out, k_cache, v_cache), expected = _step("cpu", case, **options)
    np.testing.assert_array_equal(k_cache, np.asarray(expected.k_cache))  # NaN pages untouched, new K/V in place
    np.testing.assert_array_equal(v_cache, np.asarray(expected.v_cache))
    np.testing.assert_allclose(out, naive_attention(expected, **options), atol=1e-5, rtol=1e-5)
    assert np.all(out[case.num_real_tokens:] == 0)
    reference, _ = _step("reference", case, **options)  # the same step through the jnp path
    np.testing.assert_allclose(out, reference[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(k_cache, reference[1])
    assert busy_slots() == 0  # every launch released its slot


def _lowered(dtype):
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype)
    m = case.meta
    k = jnp.zeros((case.q.shape[0], 2, 16), dtype)
    return jax.jit(functools.partial(cpu.write_and_attend, sm_scale=0.25)).lower(
        case.q, k, k, case.k_cache, case.v_cache, m.slot_mapping, m.kv_lens, m.block_tables,
        m.query_start_loc).as_text()


def test_float32_runs_the_custom_call_and_bfloat16_is_refused():
    """The kernel choice sends other cache dtypes to the reference (`jaxllm.kernels`); the kernel itself does not
    fall back silently."""
    assert cpu.TARGET in _lowered(jnp.float32)
    with pytest.raises(ValueError, match="reads float32 caches, not bfloat16"):
        _lowered(jnp.bfloat16)
    assert choose_kernels(platform="cpu", dtype=jnp.float32, kv_dtype=jnp.bfloat16).attention == "reference"
