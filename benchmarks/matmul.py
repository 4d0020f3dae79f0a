"""Times the matmuls of a SmolLM2 decode step with few tokens, XLA's dot (`reference`) against the CPU
skinny-matmul kernel (`cpu`, the CPU default up to `MAX_ROWS` rows), side by side, and reports the weight-read
bandwidth. Each runs two ways: over separate per-layer weights (an unrolled model) and over stacked weights in a
`lax.scan` (the scanned decoder, where XLA's dot copies each layer's slice and the kernel reads it in place).

    python benchmarks/matmul.py [--rounds 15] [--tokens 1,2,4,8,16,32,64]

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

from jaxllm.kernels import choose_kernels, matmul_kernel

E, F, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, E), (E, E), (2 * F, E), (E, F)]  # [out, in]


def _layer(matmul, x, weights, *index):
    qkv_w, o_w, gate_up_w, down_w = weights
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-5)  # as the model's RMSNorm
    q = matmul(x, qkv_w, *index)[:, :E]
    h = x + matmul(q * 0.5 + x, o_w, *index)
    gate_up = matmul(h, gate_up_w, *index).reshape(x.shape[0], F, 2)
    return h + matmul(jax.nn.silu(gate_up[..., 0]) * gate_up[..., 1], down_w, *index)


def chain(matmul):
    def step(x, layers, head):
        for weights in layers:
            x = _layer(matmul, x, weights)
        return matmul(x, head)
    return jax.jit(step)


def scanned_chain(matmul):
    def step(x, stacked, head):
        x, _ = jax.lax.scan(lambda x, i: (_layer(matmul, x, stacked, i), None), x, jnp.arange(LAYERS))
        return matmul(x, head)
    return jax.jit(step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tokens", default="1,2,4,8,16,32,64")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    layers = [[jnp.asarray(rng.standard_normal(s, np.float32) * 0.02) for s in SHAPES] for _ in range(LAYERS)]
    head = jnp.asarray(rng.standard_normal((VOCAB, E), np.float32) * 0.02)
    weight_bytes = sum(w.nbytes for layer in layers for w in layer) + head.nbytes
    stacked = [jnp.stack(ws) for ws in zip(*layers, strict=True)]
    fns = {}
    for impl in ("reference", "cpu"):
        fns[impl] = (chain(matmul_kernel(choose_kernels("reference", impl, platform="cpu"))), layers)
        fns[impl + " scan"] = (scanned_chain(matmul_kernel(choose_kernels("reference", impl, platform="cpu"))), stacked)
    print(f"weights read per step: {weight_bytes / 1e6:.0f} MB; backend {jax.default_backend()}")
    for t in [int(v) for v in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((t, E), np.float32))
        results = {}
        times = {impl: [] for impl in fns}
        for impl, (fn, weights) in fns.items():
            results[impl] = fn(x, weights, head).block_until_ready()
        for _ in range(args.rounds):  # the variants alternate, so drifting machine speed hits them alike
            for impl, (fn, weights) in fns.items():
                start = time.perf_counter()
                fn(x, weights, head).block_until_ready()
                times[impl].append(time.perf_counter() - start)
        for impl in fns:
            sec = statistics.median(times[impl])
            print(f"{t:3d} tokens  {impl:14s} {sec * 1e3:7.2f} ms  {weight_bytes / sec / 1e9:5.1f} GB/s")
        ref = results["reference"]
        diff = max(float(jnp.max(jnp.abs(r - ref)) / jnp.max(jnp.abs(ref))) for r in results.values())
        print(f"{t:3d} tokens  max relative difference to reference {diff:.1e}")


if __name__ == "__main__":
    main()
