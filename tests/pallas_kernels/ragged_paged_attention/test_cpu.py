"""The numba CPU kernel (direct and through its XLA FFI custom call) against a naive dense attention."""

import jax
import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.cpu_kernel import attend_parallel, attend_serial
from tests.pallas_kernels.ragged_paged_attention.cases import KINDS, make_case, run
from tests.pallas_kernels.ragged_paged_attention.test_reference import naive_attention

OPTIONS = [{}, {"sliding_window": 9}, {"soft_cap": 5.0}]


def _direct(kernel, case, block_q, sliding_window=None, soft_cap=None):
    m = case.meta
    q = np.asarray(case.q)
    out = np.full_like(q, np.nan)  # every element must be written, padding rows included
    kernel(q, np.asarray(case.k_cache), np.asarray(case.v_cache), np.asarray(m.kv_lens),
           np.asarray(m.block_tables), np.asarray(m.query_start_loc), out, np.float32(q.shape[-1] ** -0.5),
           sliding_window or 0, np.float32(soft_cap or 0.0), block_q)
    return out


@pytest.mark.parametrize("kernel", [attend_serial, attend_parallel], ids=["serial", "parallel"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("block_q", [1, 4])
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_kernel_matches_naive_dense(kernel, kind, block_q, options):
    case = make_case(kind, num_heads=6, num_kv_heads=2, head_dim=32, page_size=8, dtype=np.float32)
    got = _direct(kernel, case, block_q, **options)
    np.testing.assert_allclose(got, naive_attention(case, **options), atol=1e-5, rtol=1e-5)
    assert np.all(got[case.num_real_tokens:] == 0)


def _lowered(fn, case, **options):
    m = case.meta
    return jax.jit(lambda q, k, v, lens, tables, starts: fn(q, k, v, lens, tables, starts,
                                                              sm_scale=0.125, **options)).lower(
        case.q, case.k_cache, case.v_cache, m.kv_lens, m.block_tables, m.query_start_loc).as_text()


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "window", "softcap"])
def test_steps_run_the_custom_call(kind, options):
    case = make_case(kind, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float32)
    assert cpu.TARGET in _lowered(cpu.ragged_paged_attention, case, **options)
    got = run(jax.jit(cpu.ragged_paged_attention, static_argnames=("sm_scale", "sliding_window", "soft_cap")),
              case, **options)
    np.testing.assert_allclose(got, naive_attention(case, **options), atol=1e-5, rtol=1e-5)
    assert np.all(got[case.num_real_tokens:] == 0)


def test_bfloat16_cache_runs_the_reference():
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=jax.numpy.bfloat16)
    assert cpu.TARGET not in _lowered(cpu.ragged_paged_attention, case)
