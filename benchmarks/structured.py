"""Structured outputs' cost: 32 concurrent requests constrained by JSON schemas against the same 32 requests
unconstrained, in the same run, alternating; each unconstrained request generates exactly as many tokens as its
constrained twin did (EOS ignored), so both runs decode the same number of tokens with the same batch occupancy.
Also reported: grammar compile time per schema (fresh compiles) and the host's mask fill time per step.

    python benchmarks/structured.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jsonschema
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.structured_cases import MODELS, PROMPTS  # noqa: E402
from jaxllm import LLM, SamplingParams  # noqa: E402
from jaxllm.engine.structured_output import GrammarCompiler  # noqa: E402
from jaxllm.sampling_params import StructuredOutputsParams  # noqa: E402

REQUESTS = 32


def clear_prefix_cache(llm: LLM) -> None:
    llm.engine.block_manager.page_of_hash.clear()
    llm.engine.block_manager.hash_of_page.clear()


def pct(xs, q):
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    llm = LLM(preset="smollm2-cpu", quantization="none", max_num_seqs=REQUESTS, max_num_batched_tokens=512,
              num_pages=640, max_model_len=1024)  # float32 weights, as the README's figures were measured
    tok = llm.get_tokenizer()
    schemas = [MODELS[i % len(MODELS)].model_json_schema() for i in range(REQUESTS)]
    prompts = [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} Answer in JSON."}], add_generation_prompt=True)}
        for i in range(REQUESTS)]

    # grammar compile time: a fresh compiler, each schema once
    fresh = GrammarCompiler(tok, llm.engine.limits.vocab_size, llm.engine.eos_token_ids)
    for model in MODELS:
        fresh.matcher(StructuredOutputsParams(json=model.model_json_schema()))
    compile_s = list(fresh.compile_seconds)

    constrained = [SamplingParams(temperature=0.8, seed=i, max_tokens=256, structured_outputs={"json": s})
                   for i, s in enumerate(schemas)]
    llm.generate(prompts[:2], constrained[:2], use_tqdm=False)  # touch every code path once
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, constrained, use_tqdm=False)]
    free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
    runner = llm.engine.runner
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    mask_s: list[float] = []
    for _ in range(args.rounds):
        for name, params in (("constrained", constrained), ("unconstrained", free)):
            clear_prefix_cache(llm)
            runner.mask_seconds.clear()
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / elapsed)
            if name == "constrained":
                mask_s += list(runner.mask_seconds)
                for o, s in zip(outs, schemas, strict=True):  # every output is valid, or the figure means nothing
                    if o.outputs[0].finish_reason == "stop":

                        jsonschema.validate(json.loads(o.outputs[0].text), s)
    med = {k: statistics.median(v) for k, v in rates.items()}
    report = {"requests": REQUESTS, "tokens": sum(lengths), "rounds": args.rounds, "tok_s": rates,
              "median_tok_s": med, "ratio": med["constrained"] / med["unconstrained"],
              "compile_ms": {"median": pct(compile_s, 50), "p99": pct(compile_s, 99), "schemas": len(compile_s)},
              "mask_ms_per_step": {"median": pct(mask_s, 50), "p99": pct(mask_s, 99), "steps": len(mask_s)}}
    print(f"{REQUESTS} requests, {sum(lengths)} tokens; generated tok/s (median of {args.rounds}): constrained "
          f"{med['constrained']:.1f}, unconstrained {med['unconstrained']:.1f}, ratio {report['ratio']:.3f}")
    print(f"grammar compile per schema: median {report['compile_ms']['median']:.2f} ms, p99 "
          f"{report['compile_ms']['p99']:.2f} ms; mask fill per step: median "
          f"{report['mask_ms_per_step']['median']:.2f} ms, p99 {report['mask_ms_per_step']['p99']:.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
