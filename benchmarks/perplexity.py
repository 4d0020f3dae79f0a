"""Perplexity of the embedded SmolLM2 GGUF on a committed text (benchmarks/data/perplexity.txt, the GPL-3 text),
jaxllm against `llama-perplexity` on the same file: what int8 activations cost in accuracy.

Scored as llama-perplexity scores (`-c 512`): the text's tokens in chunks of 512, each chunk's second half
predicted from the tokens before it in the chunk (positions 257-511: 255 predictions a chunk), perplexity =
exp(mean negative log-likelihood). jaxllm runs `LLM()` (its defaults: int8 activations on the host's widest
integer path) and, in other processes, with ``JAXLLM_CPU_INT8_ISA=none`` (float activations) and, on a CPU with
AMX, ``=amx`` (the opt-in tile path, which rounds differently); log-likelihoods come from ``prompt_logprobs``.

    python benchmarks/perplexity.py [--ctx 512] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import machine
import peers

TEXT = Path(__file__).parent / "data" / "perplexity.txt"


def run_jaxllm(ctx: int) -> dict:
    from jaxllm import LLM, SamplingParams
    from pallas_kernels.quantized_matmul import isa

    llm = LLM()
    ids = llm.get_tokenizer().encode(TEXT.read_text(), add_special_tokens=False)
    chunks = [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    nll = []
    for chunk, out in zip(chunks, outs, strict=True):
        for pos in range(ctx // 2 + 1, ctx):
            nll.append(-out.prompt_logprobs[pos][chunk[pos]].logprob)
    return {"ppl": math.exp(sum(nll) / len(nll)), "tokens": len(ids), "chunks": len(chunks),
            "int8_path": isa.best()}


def run_isolated(ctx: int, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--engine", "--ctx", str(ctx), "--json", str(out)], check=True,
                       env={**os.environ, **env})
        return json.loads(out.read_text())


def run_llama(peer: Path, model: str, ctx: int) -> dict:
    log = peers.run_tool([str(peer / "bin" / "llama-perplexity"), "-m", model, "-f", str(TEXT), "-c", str(ctx),
                          "-t", "2", "-b", str(ctx)], peers.BATCHED_NO_REPACK, with_stderr=True)
    ppl = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    tokens = re.search(r"tokenization took .*?\n.*?(\d+) tokens", log)
    if ppl is None:
        raise RuntimeError(f"llama-perplexity printed no estimate:\n{log[-2000:]}")
    return {"ppl": float(ppl.group(1)), "chunks": int(chunks.group(1)) if chunks else None,
            "tokens": int(tokens.group(1)) if tokens else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--json")
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)  # one run, here
    args = p.parse_args()
    if args.engine:
        Path(args.json).write_text(json.dumps(run_jaxllm(args.ctx)))
        return
    from jaxllm.loading.embedded import embedded_model_path

    results = {"jaxllm (defaults)": run_isolated(args.ctx, {}),
               "jaxllm (float activations)": run_isolated(args.ctx, {"JAXLLM_CPU_INT8_ISA": "none"})}
    from pallas_kernels.quantized_matmul import isa

    if "amx" in isa.available():  # the opt-in path: its own rounding
        results["jaxllm (amx)"] = run_isolated(args.ctx, {"JAXLLM_CPU_INT8_ISA": "amx"})
    peer = peers.peer_dir()
    if peer is not None:
        results["llama.cpp"] = run_llama(peer, str(embedded_model_path()), args.ctx)
    host = machine.describe()
    print(machine.line(host))
    print(f"{'engine':28s} {'PPL':>9s} {'chunks':>7s}")
    for k, v in results.items():
        print(f"{k:28s} {v['ppl']:9.4f} {v['chunks']!s:>7s}")
    ratios = {}
    if "llama.cpp" in results:
        for k in (k for k in results if k.startswith("jaxllm")):
            ratios[f"{k} / llama.cpp"] = results[k]["ppl"] / results["llama.cpp"]["ppl"]
            print(f"{k} / llama.cpp: {ratios[f'{k} / llama.cpp']:.4f}")
    machine.save(args.json, host, ctx=args.ctx, results=results, ratios=ratios,
                 llama_repack_off=sorted(set(peers.repack_off)))


if __name__ == "__main__":
    main()
