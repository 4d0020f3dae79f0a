"""Times loading the embedded SmolLM2: GGUF dequantization + placement against an orbax restore of the
converted parameters. Each is timed in a fresh process (JAX started, imports done, the CPU kernels registered)
and the median of --rounds is reported.

    python benchmarks/load.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = """
import json, sys, time
import gguf.quants, orbax.checkpoint, jax.numpy as jnp
from jaxllm.loading import load_model
from pallas_kernels.ragged_paged_attention.cpu import register as register_attention
from pallas_kernels.skinny_matmul.cpu import register as register_matmul
jnp.zeros(1).block_until_ready()
register_attention(), register_matmul()  # the CPU kernels (numba) are start-up work of their own, not loading
t = time.perf_counter()
load_model(None if sys.argv[1] == "gguf" else sys.argv[1], dtype="float32")
print(json.dumps(time.perf_counter() - t))
"""


def timed(source: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, source], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    from jaxllm.loading import load_model
    from jaxllm.loading.checkpoint import save_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        lm = load_model(None, dtype="float32")
        save_checkpoint(lm.model, tmp, tokenizer=lm.tokenizer)
        gguf_s, orbax_s = [], []
        for _ in range(args.rounds):  # interleaved, so both see the same machine load
            gguf_s.append(timed("gguf"))
            orbax_s.append(timed(tmp))
    g, o = statistics.median(gguf_s), statistics.median(orbax_s)
    print(f"SmolLM2-135M f32: GGUF convert {g:.2f} s, orbax restore {o:.2f} s (median of {args.rounds}); "
          f"restore is {g / o:.2f}x faster")


if __name__ == "__main__":
    main()
