"""Multi-LoRA's cost on the embedded SmolLM2 (`LLM()` defaults, the `smollm2-cpu` preset): the plain engine against
the same engine with ``enable_lora=True, max_loras=4, max_lora_rank=16`` serving four random rank-16 adapters (every
projection of every layer targeted), both engines in one process, alternating over rounds (in separate processes
one engine's single stream spread over 102-150 tok/s: `family_cost.py`). Batched: 32 streams (the LoRA engine's
mixing the four adapters, eight each) of 64-token prompts, 128 new tokens each; single stream: one such request at
a time (the LoRA engine's with an adapter). Greedy, EOS ignored: both engines produce the same
number of tokens.

    python benchmarks/lora.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import machine
import numpy as np

STREAMS, PROMPT_LEN, NEW_TOKENS, SINGLE = 32, 64, 128, 3
ADAPTERS, RANK = 4, 16
MODULES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapters(folder: Path, cfg) -> list[Path]:
    """Four random PEFT adapters for the model of config `cfg`, as PEFT saves them."""
    from safetensors.numpy import save_file

    from jaxllm.models.lora import module_shape
    paths = []
    for i in range(ADAPTERS):
        rng = np.random.default_rng(i)
        tensors = {}
        for layer in range(cfg.num_layers):
            for block, names in MODULES.items():
                for name in names:
                    out, inp = module_shape(cfg, name)
                    key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                    tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((RANK, inp)) * 0.01).astype(np.float32)
                    tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((out, RANK)) * 0.01).astype(np.float32)
        path = folder / f"adapter{i}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
            "target_modules": [n for names in MODULES.values() for n in names]}))
        paths.append(path)
    return paths


def build(lora: bool):
    """(engine, prompts, each prompt's adapter) for the plain engine or the LoRA one."""
    from jaxllm import LLM, LoRARequest

    llm = LLM(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK) if lora else LLM()
    rng = np.random.default_rng(0)
    vocab = llm.engine.model.config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, PROMPT_LEN).tolist()} for _ in range(STREAMS)]
    requests = [None] * STREAMS
    if lora:
        paths = write_adapters(Path(tempfile.mkdtemp()), llm.engine.model.config)
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        requests = [adapters[i % ADAPTERS] for i in range(STREAMS)]
    return llm, prompts, requests


def measure(llm, prompts, requests) -> dict:
    """Batched: all the streams in one call; single: SINGLE requests one after another."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    batched = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    tokens, seconds = 0, 0.0
    for i in range(SINGLE):
        start = time.perf_counter()
        out = llm.generate(prompts[i], params, use_tqdm=False, lora_request=requests[i])[0].outputs[0]
        seconds += time.perf_counter() - start
        tokens += len(out.token_ids)
    return {"batched_tok_s": batched, "single_tok_s": tokens / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    engines = {"base": build(False), "lora": build(True)}
    for llm, prompts, requests in engines.values():  # every bucket and code path once, before timing
        measure(llm, prompts[:4], requests[:4])
    runs: dict[str, list[dict]] = {"base": [], "lora": []}
    for r in range(args.rounds):
        for name in (("base", "lora") if r % 2 == 0 else ("lora", "base")):
            runs[name].append(measure(*engines[name]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    result = {"machine": machine.describe(), "rounds": args.rounds, "runs": runs, "median": med,
              "ratio": {k: med["lora"][k] / med["base"][k] for k in med["base"]}}
    print("\n| workload | base tok/s | LoRA tok/s | ratio |\n|---|---|---|---|")
    for k, label in (("batched_tok_s", f"{STREAMS} streams (four adapters mixed)"),
                     ("single_tok_s", "single stream (with an adapter)")):
        print(f"| {label} | {med['base'][k]:.1f} | {med['lora'][k]:.1f} | {result['ratio'][k]:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
