"""Times ragged paged attention on CPU, the jnp reference and the numba kernel behind an XLA custom call
(`attn_impl="cpu"`, the CPU default), side by side, and reports the achieved KV-read bandwidth against this
machine's measured memory bandwidth.

    python benchmarks/attention.py [--rounds 5] [--kv-cache-dtype float32,float16,bfloat16]

Shapes follow SmolLM2 (9 q heads, 3 KV heads, head_dim 64; float32 queries, caches of each dtype asked for),
page size 16, one layer.
- decode: 64 sequences x 1024 tokens of context, one query token each;
- mixed: 32 decodes at 1024 context + 2 prefill chunks of 256 tokens (one at offset 512, one fresh).

With --decode-one: the CPU kernel alone on one decoding sequence (a single stream's step) at each context of
--contexts, float16 cache, called once a layer in a scan of 30 layers as a step calls it, each layer on its own
pages; microseconds a call. --query-tokens N gives that sequence N query tokens instead of one (a speculative
step's k + 1, or a prefill chunk: N = the context for a fresh prompt).

    python benchmarks/attention.py --decode-one --query-tokens 8 --contexts 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.kernels import attention_kernel, choose_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged_batch import random_paged_batch  # noqa: E402 (beside this script)

IMPLS = ("reference", "cpu")

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16


def memory_bandwidth_gbs(rounds: int) -> float:
    """Read+write bandwidth of a 512 MiB copy (the same measure as ../shared/peers)."""
    src = np.ones(512 * 2**20 // 8)
    dst = np.empty_like(src)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return 2 * src.nbytes / statistics.median(times) / 1e9


def bench(name: str, impl: str, seqs: list[tuple[int, int]], rounds: int, kv_dtype=jnp.float32) -> float:
    q, _, k, v, meta = random_paged_batch(seqs, (HEADS, KV_HEADS, HEAD_DIM), PAGE, jnp.float32)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    t = q.shape[0]
    # The engine's step: this step's K/V written into the (donated) cache, then attention. Here the written
    # slots are all padding (-1), so the timing is the attention's.
    step = attention_kernel(choose_kernels(impl, kv_dtype=kv_dtype))
    new = jnp.zeros((t, KV_HEADS, HEAD_DIM), jnp.float32)
    no_slots = jnp.full((t,), -1, jnp.int32)
    fn = jax.jit(lambda q, k, v, m: step(q, new, new, k, v, no_slots, m.kv_lens, m.block_tables, m.query_start_loc,
                                         sm_scale=HEAD_DIM ** -0.5), donate_argnums=(1, 2))
    out, k, v = fn(q, k, v, meta)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        out, k, v = fn(q, k, v, meta)
        out.block_until_ready()
        times.append(time.perf_counter() - start)
    sec = statistics.median(times)
    # each sequence's K and V, once
    kv_bytes = 2 * sum(ctx for _, ctx in seqs) * KV_HEADS * HEAD_DIM * jnp.dtype(kv_dtype).itemsize
    print(f"{impl:9s} {jnp.dtype(kv_dtype).name:8s} {name:7s} {t:5d} tokens, {len(seqs):3d} seqs: {sec * 1e3:7.2f} ms, "
          f"KV read {kv_bytes / 1e6:6.1f} MB -> {kv_bytes / sec / 1e9:5.2f} GB/s")
    return kv_bytes / sec / 1e9


def decode_one(contexts: list[int], rounds: int, layers: int = 30, query_tokens: int = 1) -> dict[int, float]:
    """Microseconds a layer's call of the CPU kernel takes for one sequence with `query_tokens` query tokens (1: a
    decode) at each context."""
    step = attention_kernel(choose_kernels("cpu", kv_dtype=jnp.float16))
    result = {}
    for ctx in contexts:
        q, _, k, v, meta = random_paged_batch([(query_tokens, ctx)], (HEADS, KV_HEADS, HEAD_DIM), PAGE,
                                              jnp.float32)
        # every layer its own pages, as in the engine's cache (layer l's page p is l * pages + p): a step reads
        # layers x the sequence's K/V, not one layer's from cache 30 times
        pages = k.shape[1]
        k, v = (jnp.tile(c.astype(jnp.float16), (1, layers, 1, 1)) for c in (k, v))
        new = jnp.zeros((query_tokens, KV_HEADS, HEAD_DIM), jnp.float16)
        no_slots = jnp.full((query_tokens,), -1, jnp.int32)

        def walk(q, k, v, m, new=new, no_slots=no_slots, pages=pages):
            def body(carry, index):
                c, k, v = carry  # the caches carried, as the engine's layers pass them: updated in place, not copied
                out, k, v = step(c, new, new, k, v, no_slots, m.kv_lens, m.block_tables + index * pages,
                                 m.query_start_loc, sm_scale=HEAD_DIM ** -0.5)
                return (c + 1e-3 * out, k, v), None  # each layer's call waits for the one before
            return jax.lax.scan(body, (q, k, v), jnp.arange(layers, dtype=jnp.int32))[0]

        fn = jax.jit(walk, donate_argnums=(1, 2))
        q, k, v = fn(q, k, v, meta)
        times = []
        for _ in range(max(rounds, 50)):
            start = time.perf_counter()
            q, k, v = fn(q, k, v, meta)
            q.block_until_ready()
            times.append((time.perf_counter() - start) / layers)
        result[ctx] = statistics.median(times) * 1e6
        print(f"one sequence, {query_tokens:3d} query tokens, {ctx:5d} tokens of context: {result[ctx]:7.1f} us "
              "a layer")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--kv-cache-dtype", default="float32", help="comma-separated cache dtypes")
    p.add_argument("--decode-one", action="store_true", help="one decoding sequence at each of --contexts")
    p.add_argument("--contexts", default="150,512,1024,4096")
    p.add_argument("--query-tokens", type=int, default=1, help="with --decode-one: the sequence's query tokens")
    args = p.parse_args()
    if args.decode_one:
        decode_one([int(c) for c in args.contexts.split(",")], args.rounds, query_tokens=args.query_tokens)
        return
    bw = memory_bandwidth_gbs(args.rounds)
    print(f"memory bandwidth (512 MiB copy, read+write): {bw:.1f} GB/s; backend {jax.default_backend()}, "
          f"{jax.device_count()} device(s)")
    for dtype in args.kv_cache_dtype.split(","):
        for impl in IMPLS:
            decode = bench("decode", impl, [(1, 1024)] * 64, args.rounds, dtype)
            mixed = bench("mixed", impl, [(1, 1024)] * 32 + [(256, 768), (256, 256)], args.rounds, dtype)
            print(f"{impl} {dtype}: decode reaches {decode / bw:.0%} and mixed {mixed / bw:.0%} of the copy "
                  "bandwidth")


if __name__ == "__main__":
    main()
