"""The CPU ragged paged attention kernel: a numba loop nest, compiled to machine code, that reads each page in
place.

XLA:CPU runs the jnp reference as "gather the pages into a temporary, then batched matmuls"; for decode the
matmuls are tiny (``group x head_dim`` by ``head_dim x block``) and the gathered copy is written and read
again, so a decode step spends ~3x the KV bytes in memory traffic. This kernel walks each sequence's block
table and folds one page at a time into an online softmax, with (sequence, kv head) work items spread over
the cores by ``numba.prange``.

Numerics match the reference (float32 accumulation, the same online-softmax algebra).
"""

from __future__ import annotations

import math

import numba
import numpy as np

NEG = np.float32(-3.0e38)  # finite: max() against it stays well defined


@numba.njit(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True, inline="always")
def _fold_page(qs, acc, m, l, sc, kp, vp, rows, group, base, start, first, window, soft_cap):  # noqa: E741
    """Folds one page (``kp``/``vp`` [page_size, D]) into the running softmax of ``rows`` query rows."""
    page_size, d = kp.shape
    for r in range(rows):
        for c in range(page_size):
            a = np.float32(0.0)
            for x in range(d):
                a += qs[r, x] * kp[c, x]
            sc[r, c] = a
    # Pages wholly inside every row's causal window need no masking (the common case).
    full = base >= start and base + page_size - 1 <= first and window <= 0
    for r in range(rows):
        qpos = first + r // group
        row_max = NEG
        for c in range(page_size):
            s = sc[r, c]
            if soft_cap > 0:
                s = soft_cap * math.tanh(s / soft_cap)
            if not full:
                pos = base + c
                if pos > qpos or pos < start or (window > 0 and pos <= qpos - window):
                    s = NEG
            sc[r, c] = s
            row_max = max(row_max, s)
        if row_max == NEG:
            continue
        m_new = max(m[r], row_max)
        alpha = math.exp(m[r] - m_new)
        m[r] = m_new
        total = l[r] * alpha
        for x in range(d):
            acc[r, x] *= alpha
        for c in range(page_size):
            if sc[r, c] != NEG:
                p = math.exp(sc[r, c] - m_new)
                total += p
                for x in range(d):
                    acc[r, x] += p * vp[c, x]
        l[r] = total


def _attend(q, k_cache, v_cache, kv_lens, block_tables, query_start_loc, out, sm_scale, window, soft_cap,
            block_q):
    """q, out [T, H, D]; caches [KVH, P, page, D]; window <= 0 and soft_cap <= 0 mean "none"."""
    t, h, d = q.shape
    kvh, _, page_size, _ = k_cache.shape
    group = h // kvh
    num_seqs = kv_lens.shape[0]
    out[:] = 0.0  # padding tokens and empty sequences
    for item in numba.prange(num_seqs * kvh):
        s = item // kvh
        kh = item - s * kvh
        q0 = query_start_loc[s]
        q_len = query_start_loc[s + 1] - q0
        ctx = kv_lens[s]
        if q_len <= 0 or ctx <= 0:
            continue
        rows_max = block_q * group
        qs = np.empty((rows_max, d), np.float32)  # [block_q * group, D], pre-scaled queries
        acc = np.empty((rows_max, d), np.float32)
        m = np.empty(rows_max, np.float32)
        l = np.empty(rows_max, np.float32)  # noqa: E741
        sc = np.empty((rows_max, page_size), np.float32)
        for b0 in range(0, q_len, block_q):
            nq = min(block_q, q_len - b0)
            rows = nq * group
            first = ctx - q_len + b0  # position of the block's first query token
            last = first + nq - 1
            for r in range(rows):
                tok = q0 + b0 + r // group
                head = kh * group + r % group
                for x in range(d):
                    qs[r, x] = q[tok, head, x] * sm_scale
                    acc[r, x] = 0.0
                m[r] = NEG
                l[r] = 0.0
            start = max(0, first - window + 1) if window > 0 else 0
            for pi in range(start // page_size, last // page_size + 1):
                page = block_tables[s, pi]
                _fold_page(qs, acc, m, l, sc, k_cache[kh, page], v_cache[kh, page], rows, group,
                           pi * page_size, start, first, window, soft_cap)
            for r in range(rows):
                tok = q0 + b0 + r // group
                head = kh * group + r % group
                inv = np.float32(1.0) / l[r] if l[r] > 0 else np.float32(0.0)
                for x in range(d):
                    out[tok, head, x] = acc[r, x] * inv


@numba.njit(nogil=True, boundscheck=False, cache=True)
def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """k, v [T, KVH, D] into the caches [KVH, P, page, D] at flat slots (negative: a padding token)."""
    page_size = k_cache.shape[2]
    for t in range(slot_mapping.shape[0]):
        slot = slot_mapping[t]
        if slot < 0:
            continue
        page, offset = slot // page_size, slot % page_size
        for h in range(k_cache.shape[0]):
            k_cache[h, page, offset] = k[t, h]
            v_cache[h, page, offset] = v[t, h]


_KW = dict(fastmath=True, nogil=True, error_model="numpy", boundscheck=False, cache=True)
attend_parallel = numba.njit(parallel=True, **_KW)(_attend)
attend_serial = numba.njit(**_KW)(_attend)
