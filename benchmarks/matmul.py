"""Times the matmuls of a SmolLM2 decode step with few tokens, XLA's dot (`reference`) against the CPU
skinny-matmul kernel (`cpu`, the CPU default for up to 8 rows), side by side, and reports the weight-read
bandwidth.

    python benchmarks/matmul.py [--rounds 15] [--tokens 1,2,4,8,16]

The chain is what one step runs: per layer the fused q/k/v [960 x 576], o [576 x 576], fused gate/up
[3072 x 576] and down [576 x 1536] projections (30 layers, 425 MB of float32 weights), then the tied LM head
[49152 x 576] (113 MB), with a little elementwise work between them as in the model.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.layers import select_matmul

E, F, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, E), (E, E), (2 * F, E), (E, F)]  # [out, in]


def chain(matmul):
    def step(x, layers, head):
        for qkv_w, o_w, gate_up_w, down_w in layers:
            x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)  # as the model's RMSNorm
            q = matmul(x, qkv_w)[:, :E]
            h = x + matmul(q * 0.5 + x, o_w)
            gate_up = matmul(h, gate_up_w).reshape(x.shape[0], F, 2)
            x = h + matmul(jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1], down_w)
        return matmul(x, head)
    return jax.jit(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tokens", default="1,2,4,8,16")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    layers = [[jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in SHAPES] for _ in range(LAYERS)]
    head = jnp.asarray(rng.standard_normal((VOCAB, E), np.float32) * 0.02)
    weight_bytes = sum(w.nbytes for layer in layers for w in layer) + head.nbytes
    fns = {impl: chain(select_matmul(impl)) for impl in ("reference", "cpu")}
    print(f"weights read per step: {weight_bytes / 1e6:.0f} MB; backend {jax.default_backend()}")
    for t in [int(v) for v in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((t, E), np.float32))
        results = {}
        for impl, fn in fns.items():
            results[impl] = fn(x, layers, head).block_until_ready()
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                fn(x, layers, head).block_until_ready()
                times.append(time.perf_counter() - start)
            sec = statistics.median(times)
            print(f"{t:3d} tokens  {impl:9s} {sec * 1e3:7.2f} ms  {weight_bytes / sec / 1e9:5.1f} GB/s")
        diff = float(jnp.max(jnp.abs(results["cpu"] - results["reference"])) / jnp.max(jnp.abs(results["reference"])))
        print(f"{t:3d} tokens  max relative difference {diff:.1e}")


if __name__ == "__main__":
    main()
