"""Both Pallas kernels in interpret mode against the jnp reference, and lowered for their real platform."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.ragged_paged_attention import gpu, reference, tpu
from tests.pallas_kernels.ragged_paged_attention.cases import make_case, run

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
@pytest.mark.parametrize(("kind", "dtype", "head_dim", "heads", "page_size"), MATRIX,
                         ids=[f"{k}-{jnp.dtype(t).name}-d{d}-h{h[0]}kv{h[1]}-p{p}" for k, t, d, h, p in MATRIX])
def test_kernel_matches_reference(kernel, kind, dtype, head_dim, heads, page_size):
    case = make_case(kind, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim, page_size=page_size,
                     dtype=dtype)
    _check(kernel, case, dtype)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("options", [{"sliding_window": 11}, {"soft_cap": 4.0}], ids=["window", "softcap"])
def test_kernel_options(kernel, options):
    case = make_case("mixed", num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    _check(kernel, case, jnp.float32, **options)


def test_tpu_kernel_small_pages():
    case = make_case("mixed", num_heads=6, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.float32)
    _check("tpu", case, jnp.float32)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_gpu_split_k_decode(num_splits):
    case = make_case("decode", num_heads=8, num_kv_heads=2, head_dim=64, page_size=16, dtype=jnp.float32)
    expected = run(reference.ragged_paged_attention, case)
    got = run(functools.partial(gpu.ragged_paged_attention, interpret=True, num_splits=num_splits), case)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)


def test_gpu_kernel_rejects_shapes_triton_cannot_tile():
    case = make_case("decode", num_heads=4, num_kv_heads=2, head_dim=64, page_size=8, dtype=jnp.float32)
    with pytest.raises(ValueError, match="page_size to be a power of two >= 16, got 8"):
        run(gpu.ragged_paged_attention, case)


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
