"""How fast a decode step's quantized matmuls stream their weights from memory, against the machine's own read
bandwidth measured in the same run.

Each SmolLM2 weight shape (the layers' Q4_1 projections, the Q8_0 LM head) is stacked into copies that together
exceed the last-level cache, and a jitted scan multiplies one input row by each copy in turn through the CPU
kernel, as a decode step walks its layers: every call reads its weights cold. The peer is numpy summing a 512 MiB
array (one thread, and one per core on halves): the rate a plain streaming read reaches here.

    python benchmarks/decode_stream.py [--rounds 5] [--total-mib 256] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import machine
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from jaxllm.loading.gguf_quant import FORMATS, repack
from pallas_kernels.quantized_matmul import cpu, isa

E, F, V = 576, 1536, 49152
SHAPES = {"qkv Q4_1": (T.Q4_1, 960, E), "o Q4_1": (T.Q4_1, E, E), "gate_up Q4_1": (T.Q4_1, 2 * F, E),
          "down Q4_1": (T.Q4_1, E, F), "lm_head Q8_0": (T.Q8_0, V, E)}


def numpy_read_gbs(rounds: int) -> dict[str, float]:
    """GB/s of numpy summing a 512 MiB float32 array: on one thread, and split over one thread per core."""
    a = np.ones(512 * 2**20 // 4, np.float32)
    cores = len(os.sched_getaffinity(0))
    parts = np.array_split(a, cores)

    def split():
        threads = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    out = {}
    for name, fn in (("1 thread", lambda: np.sum(a)), (f"{cores} threads", split)):
        fn()
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = a.nbytes / statistics.median(times) / 1e9
    return out


def stream(kind: T, out: int, n: int, total_bytes: int, rounds: int, path: str | None) -> dict:
    rng = np.random.default_rng(0)
    w = repack(quantize(rng.standard_normal((out, n)).astype(np.float32) * 0.02, kind), kind, (out, n))
    nbytes = sum(np.asarray(a).nbytes for a in w if a is not None)
    copies = max(2, -(-total_bytes // nbytes))
    stack = tuple(None if a is None else jnp.asarray(np.broadcast_to(np.asarray(a), (copies, *np.shape(a))))
                  for a in w)
    fmt = FORMATS[kind]

    def walk(x, stack):
        def body(c, layer):
            y = cpu.matmul(c, stack, fmt, layer, isa=path)
            return c + 1e-6 * y[:, :1], None  # each call waits for the one before, as a step's layers do
        return jax.lax.scan(body, x, jnp.arange(copies))[0]

    fn = jax.jit(walk)
    x = jnp.asarray(rng.standard_normal((1, n)).astype(np.float32))
    fn(x, stack).block_until_ready()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(x, stack).block_until_ready()
        times.append((time.perf_counter() - start) / copies)
    per_call = statistics.median(times)
    return {"bytes": nbytes, "copies": copies, "us": per_call * 1e6, "gbs": nbytes / per_call / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--total-mib", type=int, default=256, help="bytes of each shape's stack (beyond the caches)")
    p.add_argument("--json")
    args = p.parse_args()
    info = machine.describe()
    print(machine.line(info))
    path = isa.best()
    peer = numpy_read_gbs(args.rounds)
    rows = {name: stream(kind, o, n, args.total_mib << 20, args.rounds, path)
            for name, (kind, o, n) in SHAPES.items()}
    best = max(peer.values())
    print("numpy read: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in peer.items()))
    print(f"{'shape':14s} {'KB':>7s} {'us/call':>8s} {'GB/s':>6s} {'of numpy':>8s}   (int8 path: {path})")
    for name, r in rows.items():
        print(f"{name:14s} {r['bytes'] / 1e3:7.0f} {r['us']:8.1f} {r['gbs']:6.1f} {r['gbs'] / best:8.0%}")
    machine.save(args.json, info, int8_path=path, numpy_read_gbs=peer, shapes=rows)


if __name__ == "__main__":
    main()
