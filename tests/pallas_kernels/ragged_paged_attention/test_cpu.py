"""The numba CPU kernel, directly (every work item on the calling thread) and through its XLA FFI custom call
(cache write + attention, work items shared with XLA's thread pool), against a naive dense attention; float32,
float16 and bfloat16 caches."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.kernels import attention_kernel, choose_kernels
from pallas_kernels.cpu_ffi import busy_slots
from pallas_kernels.ragged_paged_attention import cpu
from pallas_kernels.ragged_paged_attention.cpu_kernel import CACHE_TYPES, LANES, ROW_LANES, WIDE_LANES, attend_serial
from tests.matrix import sampled
from tests.pallas_kernels.ragged_paged_attention.cases import KINDS, make_case
from tests.pallas_kernels.ragged_paged_attention.test_reference import SINKS, naive_attention

OPTIONS = [{}, {"sliding_window": 9}, {"soft_cap": 5.0}, {"sinks": SINKS, "sliding_window": 9}]  # sinks: the first H
OPTION_IDS = ["plain", "window", "softcap", "sinks"]
HALF_TYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16}
# the integer type the kernel sees a 16-bit cache as (the format's bits)
KERNEL_VIEW = {jnp.dtype(jnp.float16): np.uint16, jnp.dtype(jnp.bfloat16): np.int16}


def _narrowed(case, dtype):
    """The case with its caches rounded to `dtype` (queries stay float32)."""
    return dataclasses.replace(case, k_cache=case.k_cache.astype(dtype), v_cache=case.v_cache.astype(dtype))


def _direct(case, block_q, min_items, sliding_window=None, soft_cap=None, sinks=None, row_lanes=ROW_LANES):
    m = case.meta
    q = np.asarray(case.q)
    out = np.full_like(q, np.nan)  # every element must be written, padding rows included
    k_cache, v_cache = np.asarray(case.k_cache), np.asarray(case.v_cache)
    if case.k_cache.dtype in KERNEL_VIEW:
        k_cache, v_cache = (c.view(KERNEL_VIEW[case.k_cache.dtype]) for c in (k_cache, v_cache))
    attend_serial(q, k_cache, v_cache, np.asarray(m.kv_lens),
           np.asarray(m.block_tables), np.asarray(m.query_start_loc), out, np.float32(q.shape[-1] ** -0.5),
           sliding_window or 0, np.float32(soft_cap or 0.0),
           np.full(q.shape[1], cpu.NEG, np.float32) if sinks is None else sinks[:q.shape[1]], block_q,
           min_items, row_lanes)
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


LONG = [(1, 2500), (1, 1024), (1, 1025), (40, 2100), (1, 30)]  # decodes past one and two context chunks, a prompt


@pytest.mark.parametrize("options", OPTIONS + [{"sliding_window": 1100}], ids=OPTION_IDS + ["wide-window"])
@pytest.mark.parametrize("split", [False, True], ids=["items", "split-by-head"])
def test_long_contexts_split_by_chunk_match_naive_dense(options, split):
    """Keys past `CONTEXT_CHUNK` are split into chunks (each a work item, merged after): the same attention."""
    from pallas_kernels.ragged_paged_attention.cpu_kernel import CONTEXT_CHUNK

    assert max(c for _, c in LONG) > 2 * CONTEXT_CHUNK
    case = make_case("decode", num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, dtype=np.float32, seqs=LONG)
    got = _direct(case, 4, 1 << 30 if split else 0, **options)
    np.testing.assert_allclose(got, naive_attention(case, **options), atol=2e-5, rtol=1e-5)
    assert np.all(got[case.num_real_tokens:] == 0)


@pytest.mark.slow
def test_a_long_sequence_gets_the_same_bits_alone_or_in_a_batch():
    """Chunks are cut at fixed positions, merged in order: a sequence's output does not depend on the batch
    around it or on how the items are shared out (the q-head split for few items included)."""
    batch = make_case("decode", num_heads=6, num_kv_heads=2, head_dim=32, page_size=16, dtype=np.float32, seqs=LONG,
                      pad_tokens=0, pad_seqs=0)
    together = _direct(batch, 1, 0)
    starts = np.asarray(batch.meta.query_start_loc)
    for i, seq in enumerate(LONG):
        if seq[0] != 1:
            continue
        t = int(starts[i])  # the sequence's token
        alone = dataclasses.replace(batch, q=batch.q[t:t + 1], meta=dataclasses.replace(
            batch.meta, kv_lens=batch.meta.kv_lens[i:i + 1], block_tables=batch.meta.block_tables[i:i + 1],
            query_start_loc=jnp.asarray([0, 1], jnp.int32), slot_mapping=batch.meta.slot_mapping[t:t + 1]))
        for min_items in (0, 1 << 30):
            assert np.array_equal(_bits(_direct(alone, 1, min_items)[0]), _bits(together[t])), (seq, min_items)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("options", [{}, {"sliding_window": 9}, {"soft_cap": 5.0}], ids=["plain", "window", "softcap"])
@pytest.mark.parametrize("head_dim", [32, 24])
def test_a_position_gets_the_same_bits_in_a_prompt_chunk_and_in_a_decode(dtype, options, head_dim):
    """A prompt chunk's rows (lanes of 8- or 16-row groups), a decode's few rows (lanes along d) and a speculative
    step's k + 1 rows fold a page alike: each position's output is the same bits however it is computed. Slots past
    the sequence's length hold NaN, which no path may read."""
    q_len, ctx, page = 20, 37, 8
    case = make_case("prefill", num_heads=6, num_kv_heads=2, head_dim=head_dim, page_size=page, dtype=np.float32,
                     seqs=[(q_len, ctx)], pad_tokens=0, pad_seqs=0)
    k, v = np.array(case.k_cache), np.array(case.v_cache)
    last = int(case.meta.block_tables[0, (ctx - 1) // page])
    k[:, last, ctx % page:] = np.nan
    v[:, last, ctx % page:] = np.nan
    case = _narrowed(dataclasses.replace(case, k_cache=jnp.asarray(k), v_cache=jnp.asarray(v)), HALF_TYPES.get(
        dtype, jnp.float32))
    chunk = {block_q: _bits(_direct(case, block_q, 0, **options)) for block_q in (16, 4, 1)}
    assert np.array_equal(chunk[16], chunk[4]) and np.array_equal(chunk[16], chunk[1])
    # groups of 8 rows a vector and of 16 (AVX-512 hosts' default): 3 q heads a KV head, so 48, 24 (16 + a last
    # group of 8 in vectors of 8), 18 (16 + 2) and 12 rows an item
    for lanes in (LANES, WIDE_LANES):
        for block_q in (16, 8, 6, 4):
            assert np.array_equal(_bits(_direct(case, block_q, 0, row_lanes=lanes, **options)), chunk[16])
    assert not np.isnan(_direct(case, 16, 0, **options)).any()
    for t in range(q_len):
        for k_plus_1 in (1, 3):  # a decode, and the last token of a speculative step's k + 1
            first = max(0, t - k_plus_1 + 1)
            step = dataclasses.replace(case, q=case.q[first:t + 1], meta=dataclasses.replace(
                case.meta, kv_lens=jnp.asarray([ctx - q_len + t + 1], jnp.int32),
                query_start_loc=jnp.asarray([0, t + 1 - first], jnp.int32)))
            got = _direct(step, 16, 0, **options)
            assert np.array_equal(_bits(got[-1]), chunk[16][t]), (t, k_plus_1)


def test_the_kernel_views_every_cache_type_by_its_ffi_type():
    assert set(CACHE_TYPES.values()) == {np.float32, *KERNEL_VIEW.values()}
    assert {jnp.dtype(t) for t in cpu.CACHE_DTYPES} == {jnp.dtype(jnp.float32), *KERNEL_VIEW}


@pytest.mark.parametrize("dtype", sampled(sorted(HALF_TYPES), lambda d: d == "float16"))
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("options", OPTIONS[:2], ids=OPTION_IDS[:2])
def test_16_bit_caches_are_widened_exactly(dtype, kind, options):
    """The kernel reads float16 / bfloat16 pages as the float32 values they hold: its output equals float32
    attention over the rounded caches (to float32 rounding), whatever the rounding cost against the originals."""
    case = _narrowed(make_case(kind, num_heads=6, num_kv_heads=2, head_dim=32, page_size=8, dtype=np.float32),
                     HALF_TYPES[dtype])
    got = _direct(case, 4, 0, **options)
    np.testing.assert_allclose(got, naive_attention(case, **options), atol=1e-5, rtol=1e-5)
    widened = _narrowed(case, jnp.float32)
    np.testing.assert_allclose(got, _direct(widened, 4, 0, **options), atol=1e-6, rtol=1e-6)
    assert np.all(got[case.num_real_tokens:] == 0)


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.itemsize}")


def _step(impl, case, **options):
    """Writes fresh K/V for the step's tokens, then attends: -> (out, k_cache, v_cache) and the case with the
    expected caches (the new K/V written in numpy)."""
    m = case.meta
    t, kvh, d = case.q.shape[0], case.k_cache.shape[0], case.q.shape[-1]
    rng = np.random.default_rng(7)
    k_new, v_new = (rng.standard_normal((t, kvh, d)).astype(np.float32) for _ in range(2))
    expected_k, expected_v = np.array(case.k_cache), np.array(case.v_cache)  # the cache's dtype: writes round
    page_size = expected_k.shape[2]
    for tok, slot in enumerate(np.asarray(m.slot_mapping)):
        if slot >= 0:
            expected_k[:, slot // page_size, slot % page_size] = k_new[tok]
            expected_v[:, slot // page_size, slot % page_size] = v_new[tok]
    kernel = attention_kernel(choose_kernels(impl, platform="cpu", kv_dtype=case.k_cache.dtype))
    if "sinks" in options:
        options = {**options, "sinks": jnp.asarray(options["sinks"][:case.q.shape[1]])}
    step = jax.jit(functools.partial(kernel, sm_scale=d ** -0.5, **options), donate_argnums=(3, 4))
    got = step(case.q, jnp.asarray(k_new), jnp.asarray(v_new), jnp.array(case.k_cache), jnp.array(case.v_cache),
               m.slot_mapping, m.kv_lens, m.block_tables, m.query_start_loc)
    expected_case = dataclasses.replace(case, k_cache=jnp.asarray(expected_k), v_cache=jnp.asarray(expected_v))
    return [np.asarray(x) for x in got], expected_case


@pytest.mark.parametrize(("kind", "options", "dtype"), [
    *((kind, options, "float32") for kind in sorted(KINDS) for options in OPTIONS),
    *((kind, {}, dtype) for kind in sorted(KINDS) for dtype in sorted(HALF_TYPES))])
def test_custom_call_writes_the_cache_then_attends(kind, options, dtype):
    case = make_case(kind, num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float32)
    case = _narrowed(case, HALF_TYPES.get(dtype, jnp.float32))
    (out, k_cache, v_cache), expected = _step("cpu", case, **options)
    assert k_cache.dtype == case.k_cache.dtype
    # bit for bit: NaN pages untouched, the new K/V in place, rounded to the cache's type as numpy rounds them
    np.testing.assert_array_equal(_bits(k_cache), _bits(expected.k_cache))
    np.testing.assert_array_equal(_bits(v_cache), _bits(expected.v_cache))
    np.testing.assert_allclose(out, naive_attention(expected, **options), atol=1e-5, rtol=1e-5)
    assert np.all(out[case.num_real_tokens:] == 0)
    reference, _ = _step("reference", case, **options)  # the same step through the jnp path
    np.testing.assert_allclose(out, reference[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(_bits(k_cache), _bits(reference[1]))
    assert busy_slots() == 0  # every launch released its slot


@pytest.mark.parametrize("seqs", [KINDS["decode"], LONG], ids=["short-contexts", "long-contexts"])
def test_custom_call_gives_the_serial_kernels_bits(seqs):
    """Through the FFI call the items are shared with XLA's pool (split by context chunk and, for few items, by q
    head): each output is still the bits of the serial kernel."""
    case = make_case("decode", num_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float32, seqs=seqs)
    case = _narrowed(case, jnp.float16)
    (out, _, _), expected = _step("cpu", case)
    real = case.num_real_tokens
    assert np.array_equal(_bits(out[:real]), _bits(_direct(expected, 1, 0)[:real]))
    assert busy_slots() == 0


def _lowered(dtype):
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=16, page_size=4, dtype=dtype)
    m = case.meta
    k = jnp.zeros((case.q.shape[0], 2, 16), dtype)
    return jax.jit(functools.partial(cpu.write_and_attend, sm_scale=0.25)).lower(
        case.q, k, k, case.k_cache, case.v_cache, m.slot_mapping, m.kv_lens, m.block_tables,
        m.query_start_loc).as_text()


def test_float_caches_run_the_custom_call_and_float8_is_refused():
    """The kernel choice sends other cache dtypes to the reference (`jaxllm.kernels`); the kernel itself does not
    fall back silently."""
    for dtype in cpu.CACHE_DTYPES:
        assert cpu.TARGET in _lowered(dtype)
        assert choose_kernels(platform="cpu", dtype=jnp.float32, kv_dtype=dtype).attention == "cpu"
    with pytest.raises(ValueError, match="reads float32, float16 or bfloat16 caches, not float8_e4m3fn"):
        _lowered(jnp.float8_e4m3fn)
    assert choose_kernels(platform="cpu", dtype=jnp.float32, kv_dtype=jnp.float8_e4m3fn).attention == "reference"


def test_block_q_follows_the_real_sequences_not_the_buckets_padding():
    """A lone sequence's 8 verification tokens in a bucket of 8 sequence slots are one block of 8, not 8 blocks
    of a decode token each (which read every page 8 times over); a decode batch stays at 1, a prefill at the cap."""
    cases = {(0, 8, 8, 8, 8, 8, 8, 8, 8): 8, (0, 1, 2, 3, 3): 1, (0, 120, 120): cpu.MAX_BLOCK_Q, (0, 0, 0): 1,
             (0, 3, 3): 2, (0, 8, 16, 16): 8, (0, 5, 6): 2}
    for starts, want in cases.items():
        assert int(cpu.block_q_of(jnp.asarray(starts, jnp.int32))) == want, starts
