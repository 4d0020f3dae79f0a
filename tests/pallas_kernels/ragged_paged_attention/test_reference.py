"""The jnp reference against a naive dense causal attention over unpaged K/V."""

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention
from tests.pallas_kernels.ragged_paged_attention.cases import KINDS, make_case, run

# sink logits per q head (a case's first H of them): some above the scores, some far below
SINKS = np.array([0.5, -1.0, 2.0, 0.0, 3.0, -0.25, 1.5, -2.0, 4.0, -8.0, 1.0, 0.25], np.float32)


def naive_attention(case, sliding_window=None, soft_cap=None, sinks=None):
    """Per sequence: rebuild its K/V from its pages, then softmax(q k^T) v with a dense causal mask; with sinks,
    each head's sink logit is one more softmax column whose value is zero."""
    m = case.meta
    q = np.asarray(case.q, np.float64)
    k_cache, v_cache = np.asarray(case.k_cache, np.float64), np.asarray(case.v_cache, np.float64)
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    out = np.zeros_like(q)
    qsl, kv_lens, tables = np.asarray(m.query_start_loc), np.asarray(m.kv_lens), np.asarray(m.block_tables)
    for s in range(len(kv_lens)):
        if kv_lens[s] == 0:
            continue
        ctx = kv_lens[s]
        pos = np.arange(ctx)
        keys = k_cache[:, tables[s][pos // page_size], pos % page_size]  # [kvh, ctx, d]
        vals = v_cache[:, tables[s][pos // page_size], pos % page_size]
        for i, tok in enumerate(range(qsl[s], qsl[s + 1])):
            q_pos = ctx - (qsl[s + 1] - qsl[s]) + i
            for head in range(h):
                kv = head // (h // kvh)
                scores = keys[kv] @ q[tok, head] / np.sqrt(d)
                if soft_cap:
                    scores = soft_cap * np.tanh(scores / soft_cap)
                allowed = pos <= q_pos
                if sliding_window:
                    allowed &= pos > q_pos - sliding_window
                scores = np.where(allowed, scores, -np.inf)
                sink = -np.inf if sinks is None else float(sinks[head])
                top = max(scores.max(), sink)
                p = np.exp(scores - top)
                out[tok, head] = p @ vals[kv] / (p.sum() + np.exp(sink - top))
    return out


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("options", [{}, {"sliding_window": 9}, {"soft_cap": 5.0}, {"sinks": SINKS[:6]},
                                     {"sinks": SINKS[:6], "sliding_window": 9}],
                         ids=["plain", "window", "softcap", "sinks", "sinks-window"])
def test_reference_matches_naive_dense(kind, options):
    case = make_case(kind, num_heads=6, num_kv_heads=2, head_dim=32, page_size=8, dtype=np.float32)
    got = run(ragged_paged_attention, case, **options)
    expected = naive_attention(case, **options)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert np.all(got[case.num_real_tokens:] == 0)  # padding tokens: finite, zero


@pytest.mark.parametrize("kv_block_pages", [1, 3, 16])
def test_block_size_does_not_change_the_result(kv_block_pages):
    case = make_case("mixed", num_heads=4, num_kv_heads=1, head_dim=16, page_size=4, dtype=np.float32)
    np.testing.assert_allclose(run(ragged_paged_attention, case, kv_block_pages=kv_block_pages),
                               naive_attention(case), atol=1e-5, rtol=1e-5)
