"""Both Pallas kernels in interpret mode against the jnp reference, and lowered for their real platform."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.ragged_paged_attention import gpu, reference, tpu
from tests.matrix import sampled
from tests.pallas_kernels.ragged_paged_attention.cases import make_case, run
from tests.pallas_kernels.ragged_paged_attention.test_reference import SINKS

KERNELS = {"tpu": tpu.ragged_paged_attention, "gpu": gpu.ragged_paged_attention}
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
# (num_heads, num_kv_heads): MHA, GQA with a non-power-of-two group, GQA 4, MQA
HEADS = [(4, 4), (6, 2), (8, 2), (4, 1)]
PAGE_SIZES = [16, 32]

# Every (kind, dtype, head_dim) combination, cycling through head layouts and page sizes.
MATRIX = [(kind, dtype, d, HEADS[i % len(HEADS)], PAGE_SIZES[i % len(PAGE_SIZES)])
          for i, (kind, dtype, d) in enumerate(itertools.product(
              ["decode", "prefill", "mixed"], [jnp.float32, jnp.bfloat16], [64, 128]))]


def _check(kernel, case, dtype, **options):
    expected = run(reference.ragged_paged_attention, case, **options)
    got = run(functools.partial(KERNELS[kernel], interpret=True), case, **options)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert np.all(got[case.num_real_tokens:] == 0)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize(("kind", "dtype", "head_dim", "heads", "page_size"),
                         sampled(MATRIX, lambda p: MATRIX.index(p) % 3 == 0),
                         ids=[f"{k}-{jnp.dtype(t).name}-d{d}-h{h[0]}kv{h[1]}-p{p}" for k, t, d, h, p in MATRIX])
def test_kernel_matches_reference(kernel, kind, dtype, head_dim, heads, page_size):
    case = make_case(kind, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, page_size=page_size,
                     dtype=dtype)
    _check(kernel, case, dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("options", [{"sliding_window": 11}, {"soft_cap": 4.0},
                                     {"sinks": jnp.asarray(SINKS[:8]), "sliding_window": 11}],
                         ids=["window", "softcap", "sinks"])
def test_kernel_options(kernel, options):
    case = make_case("mixed", num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    _check(kernel, case, jnp.float32, **options)


def test_tpu_kernel_small_pages():
    case = make_case("mixed", num_heads=6, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.float32)
    _check("tpu", case, jnp.float32)


# Block sizes beyond the table's defaults at these small shapes: several pages per iteration (an iteration
# crossing the end of a context, and its first page cut by a window), flash-decoding splits (3 splits over
# contexts of 1-8 pages: some splits empty), larger query blocks, and blocks of 1 or 2 tokens whose 4 or 8 query
# rows (group 4) are padded to a 16-row tile.
GPU_SIZES = [gpu.BlockSizes(4, 32, 4, 2, 1), gpu.BlockSizes(4, 64, 4, 2, 3), gpu.BlockSizes(8, 48, 4, 2, 2),
             gpu.BlockSizes(16, 16, 4, 2, 1), gpu.BlockSizes(1, 32, 4, 2, 2), gpu.BlockSizes(2, 16, 4, 2, 1)]
GPU_CASES = [(kind, sizes, options) for kind in ("decode", "prefill", "mixed") for sizes in GPU_SIZES
             for options in ({}, {"sliding_window": 19, "soft_cap": 5.0}, {"sinks": jnp.asarray(SINKS[:8])})]


@pytest.mark.parametrize(("kind", "sizes", "options"),
                         sampled(GPU_CASES[::2] + GPU_CASES[1::6], lambda p: GPU_CASES.index(p) % 8 in (0, 1)),
                         ids=lambda x: str(x) if not isinstance(x, gpu.BlockSizes) else
                         f"bq{x.block_q}-kv{x.tokens_per_iter}-s{x.num_splits}")
def test_gpu_block_sizes(kind, sizes, options):
    case = make_case(kind, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    expected = run(reference.ragged_paged_attention, case, **options)
    got = run(functools.partial(gpu.ragged_paged_attention, interpret=True, sizes=sizes), case, **options)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [gpu.BlockSizes(4, 32, 4, 2, 1), gpu.BlockSizes(4, 64, 4, 2, 3),
                                   gpu.BlockSizes(1, 32, 4, 2, 2)], ids=["one-split", "3-splits", "bq1-2-splits"])
def test_gpu_sinks_fold_once_whatever_the_splits(sizes):
    """Sinks are folded by the program with one split and by the merge with several: the same attention."""
    case = make_case("decode", num_heads=6, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    options = {"sinks": jnp.asarray(SINKS[:6])}
    expected = run(reference.ragged_paged_attention, case, **options)
    got = run(functools.partial(gpu.ragged_paged_attention, interpret=True, sizes=sizes), case, **options)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.abs(got - run(reference.ragged_paged_attention, case)).max() > 1e-2  # the sinks changed it


@pytest.mark.parametrize("cache_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_gpu_narrow_caches(kind, cache_dtype):
    """bf16 queries over bf16 and fp8 caches (widened to bf16 in the kernel): the reference reads the same cache."""
    case = make_case(kind, num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.bfloat16,
                     cache_dtype=cache_dtype)
    expected = run(reference.ragged_paged_attention, case)
    got = run(functools.partial(gpu.ragged_paged_attention, interpret=True,
                                sizes=gpu.BlockSizes(4, 32, 4, 2, 2 if kind == "decode" else 1)), case)
    np.testing.assert_allclose(got, expected, atol=2e-2, rtol=2e-2)


def test_gpu_long_decode_spreads_over_every_split():
    """One long context and a short one with 4 splits: the split size follows the step's longest context (9
    pages -> 3 per split, whole iterations of 1 page), so every split has work and the merge is exact."""
    case = make_case("decode", num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32,
                     seqs=[(1, 140), (1, 3)])
    expected = run(reference.ragged_paged_attention, case)
    got = run(functools.partial(gpu.ragged_paged_attention, interpret=True, sizes=gpu.BlockSizes(4, 16, 4, 2, 4)),
              case)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_gpu_block_sizes_come_from_the_table():
    """Decode shapes take the decode row (a tile of 16 rows: the group's heads of 16 / group tokens, or of the step's
    tokens when it has fewer) and enough
    splits, when the grid has fewer than 2 programs per SM, for ~8; prefill and mixed shapes the prefill row
    (128-row tiles), one split."""
    llama8b = dict(num_kv_heads=8, group=4, head_dim=128, page_size=16, max_pages=2048)
    rows, per_iter, warps, stages = gpu.BLOCK_TABLE[("decode", 128)]
    sixteen = gpu.block_sizes(16, 16, **llama8b)
    assert (sixteen.block_q * 4, sixteen.tokens_per_iter, sixteen.num_warps, sixteen.num_stages) == (
        rows, per_iter, warps, stages)
    one = gpu.block_sizes(1, 1, **llama8b)
    assert one.block_q == 1  # a block of the step's one token (its 4 rows padded to the tile), not of padding
    assert one.num_splits == 32  # 8 programs: 132 wanted, capped at 32
    assert gpu.block_sizes(32, 32, **llama8b).num_splits == 17  # 64 programs
    assert gpu.block_sizes(64, 64, **dict(llama8b, max_pages=32)).num_splits == 8  # 128 programs; 8 iterations
    assert gpu.block_sizes(256, 256, **llama8b).num_splits == 1  # 512 programs fill the SMs already
    prefill = gpu.block_sizes(2048, 256, **llama8b)
    assert (prefill.block_q, prefill.num_splits) == (gpu.BLOCK_TABLE[("prefill", 128)][0] // 4, 1)
    # never more splits than the longest possible context has iterations (8 pages: one iteration of 128 tokens)
    assert gpu.block_sizes(1, 1, num_kv_heads=2, group=16, head_dim=64, page_size=16, max_pages=8).num_splits == 1
    assert gpu.block_sizes(1, 1, num_kv_heads=2, group=16, head_dim=64, page_size=16, max_pages=80).num_splits == 10


def test_pages_walked_counts_what_the_grid_reads():
    llama8b = dict(num_tokens=256, num_seqs=256, num_kv_heads=8, group=4, head_dim=128, page_size=16,
                   max_pages=2048)
    assert gpu.pages_walked([1] * 256, [1024] * 256, **llama8b) == 256 * 64  # decode: each page once
    prefill = dict(llama8b, num_tokens=2048)
    # two 1024-token prompts in 32-token query blocks: block b of a prompt reads its first b + 1 pairs of pages
    assert gpu.pages_walked([1024, 1024], [1024, 1024], **prefill) == 2 * sum(2 * (b + 1) for b in range(32))


def test_gpu_kernel_rejects_shapes_triton_cannot_tile():
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="page_size to be a power of two >= 16, got 8"):
        run(gpu.ragged_paged_attention, case)
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="block_q must be a power of two, got 3"):
        run(functools.partial(gpu.ragged_paged_attention, sizes=gpu.BlockSizes(3, 16, 4, 2)), case)


# Engine-sized shapes: (tokens, sequences, page_size, pages in the cache, dtype); 32 heads / 8 KV heads, D=128.
EXPORT_SHAPES = [(256, 64, 16, 2048, jnp.bfloat16), (2048, 8, 64, 512, jnp.bfloat16), (256, 256, 16, 4096, jnp.float32)]


@pytest.mark.parametrize(("platform", "kernel", "marker"), [("tpu", "tpu", "tpu_custom_call"),
                                                            ("cuda", "gpu", "__gpu$xla.gpu.triton")])
@pytest.mark.parametrize(("tokens", "seqs", "page_size", "pages", "dtype"), EXPORT_SHAPES)
def test_kernel_lowers_for_its_platform(platform, kernel, marker, tokens, seqs, page_size, pages, dtype):
    h, kvh, d, max_pages = 32, 8, 128, 128
    args = [jax.ShapeDtypeStruct((tokens, h, d), dtype),
            jax.ShapeDtypeStruct((kvh, pages, page_size, d), dtype),
            jax.ShapeDtypeStruct((kvh, pages, page_size, d), dtype),
            jax.ShapeDtypeStruct((seqs,), jnp.int32), jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((seqs + 1,), jnp.int32)]
    fn = jax.jit(functools.partial(KERNELS[kernel], sm_scale=d ** -0.5))
    exported = export.export(fn, platforms=[platform],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(marker)])(*args)
    assert marker in exported.mlir_module()
    assert exported.out_avals[0].shape == (tokens, h, d)


@pytest.mark.parametrize("kernel", ["reference", "cpu", *sorted(KERNELS)])
def test_a_window_can_be_a_runtime_value(kernel):
    """Per-layer windows under a layer scan reach the kernels as traced int32 scalars: the same numbers as the
    static window, and a whole-context window masks nothing."""
    from jaxllm.models.llama import WHOLE_CONTEXT
    from pallas_kernels.ragged_paged_attention import cpu

    case = make_case("mixed", num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    fn = {"reference": reference.ragged_paged_attention, "cpu": _cpu_attend(cpu)}.get(kernel)
    fn = fn or functools.partial(KERNELS[kernel], interpret=True)
    m = case.meta
    traced = jax.jit(lambda w: fn(case.q, case.k_cache, case.v_cache, m.kv_lens, m.block_tables, m.query_start_loc,
                                  sm_scale=case.q.shape[-1] ** -0.5, sliding_window=w))
    for window, static in ((11, 11), (WHOLE_CONTEXT, None)):
        want = run(fn, case, sliding_window=static)
        got = np.asarray(traced(jnp.int32(window)).astype(jnp.float32))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert not np.allclose(run(fn, case, sliding_window=11), run(fn, case))  # the window does mask something


def _cpu_attend(cpu):
    """The CPU kernel reads a cache it writes first: with nothing new to write (every slot -1), it only attends."""
    def attend(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, **options):
        t, _, d = q.shape
        kvh = k_cache.shape[0]
        none = jnp.zeros((t, kvh, d), k_cache.dtype)
        out, _, _ = cpu.write_and_attend(q, none, none, k_cache, v_cache, jnp.full((t,), -1, jnp.int32), kv_lens,
                                         block_tables, query_start_loc, **options)
        return out
    return attend


@pytest.mark.parametrize(("platform", "kernel", "marker"), [("tpu", "tpu", "tpu_custom_call"),
                                                            ("cuda", "gpu", "__gpu$xla.gpu.triton")])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["window", "window-sinks"])
def test_a_runtime_window_lowers_for_its_platform(platform, kernel, marker, with_sinks):
    """A layer's traced window, and its sinks (GPT-OSS: runtime values of the layer scan), in the real lowering;
    a decode step of 64 sequences, so that the GPU kernel runs flash-decoding splits and lowers their merge too."""
    tokens, seqs, page_size, pages, dtype = 64, 64, 16, 2048, jnp.bfloat16
    h, kvh, d, max_pages = 32, 8, 128, 128
    assert gpu.block_sizes(tokens, seqs, kvh, h // kvh, d, page_size, max_pages).num_splits > 1
    args = [jax.ShapeDtypeStruct((tokens, h, d), dtype),
            jax.ShapeDtypeStruct((kvh, pages, page_size, d), dtype),
            jax.ShapeDtypeStruct((kvh, pages, page_size, d), dtype),
            jax.ShapeDtypeStruct((seqs,), jnp.int32), jax.ShapeDtypeStruct((seqs, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((seqs + 1,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32),
            jax.ShapeDtypeStruct((h,), dtype)]
    fn = jax.jit(lambda *a: KERNELS[kernel](*a[:6], sm_scale=d ** -0.5, sliding_window=a[6],
                                            sinks=a[7] if with_sinks else None))
    exported = export.export(fn, platforms=[platform],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call(marker)])(*args)
    assert marker in exported.mlir_module()
    if kernel == "gpu":
        assert "ragged_paged_attention_gpu_merge" in exported.mlir_module()


@pytest.mark.parametrize(("splits", "rows", "real"), [(1, 16, 16), (3, 16, 4), (32, 16, 16), (5, 32, 8)])
def test_gpu_merge_kernel_matches_its_reference(splits, rows, real):
    """The flash-decoding merge: random partials, some splits empty (no key reached them: max at MASK_VALUE, sum
    0) and a row no split reached (its output 0)."""
    rng = np.random.default_rng(splits * rows + real)
    kvh, blocks, d = 2, 3, 64
    acc = rng.standard_normal((splits, kvh, blocks * rows, d)).astype(np.float32)
    m = rng.standard_normal((splits, kvh, blocks * rows)).astype(np.float32)
    denom = rng.uniform(0.5, 4.0, (splits, kvh, blocks * rows)).astype(np.float32)
    empty = rng.random((splits, kvh, blocks * rows)) < 0.3
    empty[:, 0, 1] = True
    m[empty], denom[empty], acc[empty] = reference.MASK_VALUE, 0.0, 0.0
    args = [jnp.asarray(x) for x in (acc, m, denom)]
    sinks = jnp.asarray(rng.standard_normal((kvh, rows)).astype(np.float32))
    for extra in ({}, {"sinks": sinks}):
        want = gpu.merge_splits_reference(*args, rows=rows, real=real, out_dtype=jnp.float32, **extra)
        got = gpu.merge_splits(*args, rows=rows, real=real, out_dtype=jnp.float32, interpret=True, **extra)
        assert got.shape == (kvh, blocks * real, d)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert np.all(np.asarray(got)[0, 1] == 0)
