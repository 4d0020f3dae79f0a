"""The decode step's matmuls on a GPU: the Pallas skinny matmul (`pallas_kernels.skinny_matmul.gpu`) against XLA's
GEMM (cuBLAS) at a model's weight shapes, in weight GB/s against the device's HBM bandwidth; and a sweep of the
kernel's block sizes at one row. Part 5 of `device_check.py` (which passes the model and the device); alone:

    python benchmarks/skinny_matmul_speed.py [--smoke]      # on a GPU host; --smoke: tiny shapes, interpreted

Each timed call runs one matmul per copy of the weight (enough copies for 1 GB or more, so that the L2 cache never
holds the next copy's weight and the device's time hides the host's), calls queued back to back, and counts each
copy's weight bytes once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import ModelConfig
from pallas_kernels.skinny_matmul import gpu
from pallas_kernels.skinny_matmul.reference import matmul as xla_matmul

MIN_COPY_BYTES = 1 << 30
# Calls queued per timed round: a call's host dispatch and the wait for it (~0.3 ms on an H100 host) overlap the
# calls before it. Timed one call at a time with 256 MB of copies, that overhead was most of a small weight's time
# (q/k/v: 54 us a matmul; queued over 1 GB, 24.5-28.6 us).
CALLS = 5


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """A decoder layer's weights (q/k/v and gate/up fused, as the model keeps them) and the LM head, [out, in]."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv_proj": (q + 2 * kv, cfg.hidden_size), "o_proj": (cfg.hidden_size, q),
            "gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size), "lm_head": (cfg.vocab_size, cfg.hidden_size)}


def _weights(n: int, k: int, copies: int) -> list[jax.Array]:
    make = jax.jit(lambda key: (0.02 * jax.random.normal(key, (n, k), jnp.float32)).astype(jnp.bfloat16))
    return [make(key) for key in jax.random.split(jax.random.key(n * 31 + k), copies)]


def _time(fn, x, ws, rounds: int, calls: int = CALLS) -> float:
    """Seconds per matmul: the median round over `rounds` (a round: `calls` calls queued back to back, one wait),
    divided by the calls and the copies each runs."""
    jax.block_until_ready(fn(x, ws))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(x, ws)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / calls / len(ws)


def variants(base: gpu.BlockSizes, n: int, k: int) -> list[gpu.BlockSizes]:
    """The table's choice and its neighbours: tile widths with the splits that fill the chip and with none, the
    input block, the pipeline depth and the warps."""
    out = {base}
    for block_n in (16, 32, 64, 128):
        if n % block_n == 0:
            out.add(dataclasses.replace(base, block_n=block_n, splits=1))
            filled = gpu.block_sizes(n, k, table=(block_n, base.block_k, base.num_warps, base.num_stages))
            if filled is not None and filled.block_n == block_n:
                out.add(filled)
    for block_k in (128, 512):
        if k % (block_k * base.splits) == 0:
            out.add(dataclasses.replace(base, block_k=block_k))
    out |= {dataclasses.replace(base, num_stages=st) for st in (3, 5)}
    out.add(dataclasses.replace(base, num_warps=8))
    return sorted(out, key=lambda b: (b != base, dataclasses.astuple(b)))


def run(cfg: ModelConfig, hbm_bytes_per_s: float | None, rows: tuple[int, ...] = (1, 16), rounds: int = 10,
        sweep: bool = True, interpret: bool = False, min_copy_bytes: int = MIN_COPY_BYTES) -> dict:
    """Rows: for each weight and row count, XLA's GEMM and the kernel with the table's block sizes; sweep: the
    block-size variants at one row."""
    table, swept, ok = [], [], True
    rng = np.random.default_rng(0)
    for name, (n, k) in weight_shapes(cfg).items():
        nbytes = n * k * 2
        ws = _weights(n, k, max(2, -(-min_copy_bytes // nbytes)))
        base = gpu.block_sizes(n, k)

        def gbs(sec, nbytes=nbytes):
            return round(nbytes / sec / 1e9, 1)

        def frac(sec, nbytes=nbytes):
            return round(nbytes / sec / hbm_bytes_per_s, 4) if hbm_bytes_per_s else None

        for t in rows:
            x = jnp.asarray(rng.standard_normal((t, k)) * 0.5, jnp.bfloat16)
            xla = jax.jit(lambda x, ws: [xla_matmul(x, w) for w in ws])
            xla_s = _time(xla, x, ws, rounds)
            row = {"weight": name, "shape": f"{n}x{k}", "rows": t, "xla_us": round(xla_s * 1e6, 1),
                   "xla_GB_s": gbs(xla_s), "xla_fraction": frac(xla_s)}
            if base is not None:
                kern = jax.jit(lambda x, ws, sizes=base: [gpu._matmul_2d(x, w, sizes, interpret) for w in ws])
                got = np.asarray(kern(x, ws[:1])[0], np.float64)
                want = np.asarray(x, np.float64) @ np.asarray(ws[0], np.float64).T
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                ok &= err < 1e-2
                k_s = _time(kern, x, ws, rounds)
                row |= {"sizes": str(dataclasses.astuple(base)), "kernel_us": round(k_s * 1e6, 1),
                        "kernel_GB_s": gbs(k_s), "kernel_fraction": frac(k_s), "speedup": round(xla_s / k_s, 3),
                        "rel_err": float(f"{err:.3g}")}
            table.append(row)
        if sweep and base is not None:
            x = jnp.asarray(rng.standard_normal((1, k)) * 0.5, jnp.bfloat16)
            for sizes in variants(base, n, k):
                fn = jax.jit(lambda x, ws, sizes=sizes: [gpu._matmul_2d(x, w, sizes, interpret) for w in ws])
                entry = {"weight": name, **dataclasses.asdict(sizes), "table": sizes == base}
                try:
                    sec = _time(fn, x, ws, rounds)
                except Exception as e:  # noqa: BLE001 (a variant the compiler rejects is recorded, not fatal)
                    swept.append(entry | {"error": str(e)[:200]})
                    continue
                swept.append(entry | {"us": round(sec * 1e6, 1), "GB_s": gbs(sec), "fraction": frac(sec)})
        del ws
    return {"ok": ok, "rows": table, "sweep": swept}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args()
    from jaxllm.plan import bundled_model_config
    if args.smoke:
        cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16)
        out = run(cfg, None, rows=(1, 3), rounds=2, interpret=True, min_copy_bytes=1)
    else:
        out = run(bundled_model_config("meta-llama/Llama-3.1-8B-Instruct"), None)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
