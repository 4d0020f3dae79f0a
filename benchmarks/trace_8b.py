"""Tracing and lowering time of every bucket of the llama-3.1-8b-h100 preset's step, measured on this CPU as a
proxy for what a GPU host pays on every cold start (random weights are not needed: the model is abstract).

    python benchmarks/trace_8b.py [--compile] [--layers stacked|unrolled]

Attention and matmuls use the jnp/XLA references (the GPU kernel would lower through Pallas' interpreter on a
CPU). With --compile each bucket is also compiled by XLA:CPU (slow; not what a GPU compile costs). --layers
unrolled traces every layer (a model whose layers differ, or the code before the scanned decoder).
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp

from jaxllm.engine.config import EngineConfig
from jaxllm.engine.model_runner import ModelRunner
from jaxllm.models.llama import LlamaForCausalLM
from jaxllm.plan import bundled_model_config


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--layers", choices=("stacked", "unrolled"), default="stacked")
    p.add_argument("--num-pages", type=int, default=64, help="KV pages (a shape only; allocated on this host)")
    args = p.parse_args()
    engine = EngineConfig.from_preset("llama-3.1-8b-h100")
    cfg = bundled_model_config(engine.served_model_name)
    model = LlamaForCausalLM(cfg, dtype=jnp.bfloat16, attn_impl="reference", matmul_impl="reference",
                             rngs=None)  # abstract parameters
    if args.layers == "stacked":
        model.stack_layers()
    runner = ModelRunner(model, num_pages=args.num_pages, page_size=engine.page_size,
                         max_model_len=engine.max_model_len, buckets=engine.buckets(), eos_token_ids=(128009,))
    totals = {"trace": 0.0, "lower": 0.0, "compile": 0.0}
    print("| bucket (tokens x seqs) | trace s | lower s |" + (" compile s |" if args.compile else ""))
    for bucket in runner.buckets:
        args = runner.abstract_args(bucket)
        start = time.perf_counter()
        traced = runner.executables.jitted.trace(*args)
        t1 = time.perf_counter()
        lowered = traced.lower()
        t2 = time.perf_counter()
        if args.compile:
            lowered.compile()
        t3 = time.perf_counter()
        for k, v in zip(totals, (t1 - start, t2 - t1, t3 - t2), strict=True):
            totals[k] += v
        print(f"| {bucket[0]} x {bucket[1]} | {t1 - start:.2f} | {t2 - t1:.2f} |" +
              (f" {t3 - t2:.2f} |" if args.compile else ""), flush=True)
    print(f"| all {len(runner.buckets)} | {totals['trace']:.2f} | {totals['lower']:.2f} |" +
          (f" {totals['compile']:.2f} |" if args.compile else ""))


if __name__ == "__main__":
    main()
