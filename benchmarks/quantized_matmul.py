"""Times one quantized matmul per SmolLM2 layer shape and step size: the CPU kernel against XLA's dot on
dequantized row tiles (`reference.tiled_matmul`, what large steps ran before the kernel took every row count),
alternating over rounds, and reports medians and GFLOP/s. The kernel serves every step shape so that a row's
result never depends on the step it shares (batch invariance); this shows what that costs, or saves, on prefill.

    python benchmarks/quantized_matmul.py [--rounds 15] [--tokens 1,8,32,128,512] [--types Q4_1,Q8_0]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from jaxllm.loading.gguf_quant import FORMATS, repack
from pallas_kernels.quantized_matmul import cpu, isa, reference
from pallas_kernels.quantized_matmul.interleave import interleave
from pallas_kernels.quantized_matmul.interleave import supports as interleave_supports

E, F = 576, 1536
SHAPES = {"qkv": (960, E), "o": (E, E), "gate_up": (2 * F, E), "down": (E, F)}  # [out, in]


def _weight(kind: T, shape: tuple[int, int], rng: np.random.Generator):
    raw = quantize(rng.standard_normal(shape).astype(np.float32) * 0.02, kind)
    return jax.tree.map(jnp.asarray, repack(raw, kind, shape)), FORMATS[kind]


def _interleaved(fn):
    """fn on the weight interleaved by 16 rows (what the engine loads for these paths)."""
    def run(x, w, fmt):
        return fn(x, w, dataclasses.replace(fmt, interleaved=True))
    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--tokens", default="1,8,32,128,512")
    p.add_argument("--types", default="Q4_1,Q8_0")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    impls = {"kernel": jax.jit(cpu.matmul, static_argnums=2),
             "xla tiles": jax.jit(reference.tiled_matmul, static_argnums=2)}
    # the integer paths first (the engine runs the first here), each this CPU runs
    impls = {**{f"int8 {path}": jax.jit(functools.partial(cpu.matmul, isa=path), static_argnums=2)
                for path in isa.available()}, **impls}
    x16 = {f"int8 {path} x16": jax.jit(_interleaved(functools.partial(cpu.matmul, isa=path)), static_argnums=2)
           for path in cpu.X16_ISAS if path in isa.available()}
    impls = {**x16, **impls}
    print(f"{'type':5s} {'shape':8s} {'tokens':>6s}  " + "  ".join(f"{k:>18s}" for k in impls) + "  kernel/xla")
    for kind in (T[name] for name in args.types.split(",")):
        for name, shape in SHAPES.items():
            w, fmt = _weight(kind, shape, rng)
            wx = jax.tree.map(jnp.asarray, interleave(jax.tree.map(np.asarray, w), fmt)) \
                if interleave_supports(fmt, shape[0]) else None
            for t in (int(v) for v in args.tokens.split(",")):
                x = jnp.asarray(rng.standard_normal((t, shape[1]), np.float32))
                run = {k: (fn, wx if k.endswith("x16") else w) for k, fn in impls.items()
                       if wx is not None or not k.endswith("x16")}
                out = {k: fn(x, ww, fmt).block_until_ready() for k, (fn, ww) in run.items()}
                for k in out:
                    ref = out["xla tiles"]
                    diff = float(jnp.max(jnp.abs(out[k] - ref)) / jnp.max(jnp.abs(ref)))
                    assert diff < (2e-2 if k.startswith("int8") else 1e-4), (kind.name, name, t, k, diff)
                times = {k: [] for k in run}
                for _ in range(args.rounds):  # alternating, so drifting machine speed hits both alike
                    for k, (fn, ww) in run.items():
                        start = time.perf_counter()
                        fn(x, ww, fmt).block_until_ready()
                        times[k].append(time.perf_counter() - start)
                med = {k: statistics.median(v) for k, v in times.items()}
                flops = 2 * t * shape[0] * shape[1]
                cells = "  ".join(f"{med[k] * 1e3:7.3f} ms {flops / med[k] / 1e9:5.0f} GF/s" if k in med else
                                  f"{'-':>18s}" for k in impls)
                print(f"{kind.name:5s} {name:8s} {t:6d}  {cells}  {med['xla tiles'] / med['kernel']:9.2f}x")


if __name__ == "__main__":
    main()
