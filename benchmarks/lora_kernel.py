"""The CPU adapter-term kernel alone (`pallas_kernels.lora_delta`), in one jitted step of SmolLM2's 120 LoRA calls
(30 layers x q/k/v, o, gate/up, down; rank 16; four slots, every token on slot 0), for float32 and bfloat16 tables:
"memory" reads each layer's own tables (a decode step's case: 20 / 10 MB a step, from memory), "cache" reads layer
0's for every call (a few hundred KB: in cache), each call's input made distinct so that XLA merges none of them.
The four cases alternate step by step; medians.

    python benchmarks/lora_kernel.py [--tokens 1] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.models.lora import row_parts
from pallas_kernels.lora_delta.cpu import lora_delta

LAYERS, SLOTS, RANK = 30, 4, 16
HIDDEN, MLP, KV = 576, 1536, 192
KINDS = {  # parts, out, in, row parts (SmolLM2: 9 heads of 64 over 3 KV heads)
    "qkv": (3, HIDDEN + 2 * KV, HIDDEN, row_parts((3, 3, 64))), "o": (1, HIDDEN, HIDDEN, None),
    "gate_up": (2, 2 * MLP, HIDDEN, row_parts((MLP,))), "down": (1, HIDDEN, MLP, None)}


def tables(dtype) -> dict:
    rng = np.random.default_rng(0)
    return {k: (jnp.asarray(rng.standard_normal((LAYERS, SLOTS, p * RANK, i)) * 0.01, dtype),
                jnp.asarray(rng.standard_normal((LAYERS, SLOTS, RANK, o)) * 0.01, dtype))
            for k, (p, o, i, _) in KINDS.items()}


def step(tabs, x, xf, slots, *, cached: bool):
    acc = jnp.float32(0)
    for layer in range(LAYERS):
        for kind, (_, _, inp, parts) in KINDS.items():
            a, b = tabs[kind]
            y = lora_delta((x if inp == HIDDEN else xf) * (layer + 1), a, b, jnp.int32(0 if cached else layer),
                           slots, parts)
            acc = acc + y[0, 0]
    return acc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    x, xf = jnp.ones((args.tokens, HIDDEN), jnp.float32), jnp.ones((args.tokens, MLP), jnp.float32)
    slots = jnp.zeros((args.tokens,), jnp.int32)
    cases = {}
    for name, dtype in (("float32", jnp.float32), ("bfloat16", jnp.bfloat16)):
        tabs = tables(dtype)
        for where in ("memory", "cache"):
            f = jax.jit(lambda t, x, xf, s, c=where == "cache": step(t, x, xf, s, cached=c))
            f(tabs, x, xf, slots).block_until_ready()
            cases[(name, where)] = (f, tabs)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in cases}
    for _ in range(args.rounds):
        for key, (f, tabs) in cases.items():
            start = time.perf_counter()
            f(tabs, x, xf, slots).block_until_ready()
            times[key].append(time.perf_counter() - start)
    print(f"| tables | read from | ms a step ({args.tokens} token(s), {LAYERS * len(KINDS)} calls) |\n|---|---|---|")
    for (name, where), ts in times.items():
        print(f"| {name} | {where} | {1e3 * statistics.median(ts):.2f} |")


if __name__ == "__main__":
    main()
