"""Multi-LoRA's cost on the embedded SmolLM2 (`LLM()` defaults, the `smollm2-cpu` preset): the plain engine against
the same engine with ``enable_lora=True, max_loras=4, max_lora_rank=16`` serving four random rank-16 adapters (every
projection of every layer targeted), the engines in one process, alternating (in separate processes one engine's
single stream spread over 102-150 tok/s: `family_cost.py`). Batched: 32 streams (the LoRA engine's mixing the four
adapters, eight each) of 64-token prompts, 128 new tokens each, three runs an engine a round, the engines alternating
run by run (~3 s a run); single stream: one such request at a time (the LoRA engine's with an adapter), six a round,
the engines alternating request by request. Greedy, EOS ignored: the engines produce the same number of tokens.
Besides the medians of rounds, the median over every run (request) of its tok/s against the plain engine's run of
the same workload beside it. ``--lora-dtypes auto,float32``
adds a LoRA engine per adapter-table dtype (`lora_dtype`; "auto": bfloat16 over the embedded model's quantized
weights), in the same rounds.

    python benchmarks/lora.py [--rounds 3] [--lora-dtypes auto] [--json out.json]
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

STREAMS, PROMPT_LEN, NEW_TOKENS, SINGLE, BATCHED = 32, 64, 128, 6, 3
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


def build(lora_dtype: str | None):
    """(engine, prompts, each prompt's adapter) for the plain engine (None) or a LoRA one."""
    from jaxllm import LLM, LoRARequest

    lora = lora_dtype is not None
    llm = LLM(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK, lora_dtype=lora_dtype) if lora else LLM()
    rng = np.random.default_rng(0)
    vocab = llm.engine.model.config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, PROMPT_LEN).tolist()} for _ in range(STREAMS)]
    requests = [None] * STREAMS
    if lora:
        paths = write_adapters(Path(tempfile.mkdtemp()), llm.engine.model.config)
        adapters = [LoRARequest(f"adapter{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        requests = [adapters[i % ADAPTERS] for i in range(STREAMS)]
    return llm, prompts, requests


def batched(llm, prompts, requests) -> float:
    """Generated tok/s of all the streams in one call."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def single(llm, prompts, requests, i: int) -> tuple[int, float]:
    """(tokens, seconds) of request i alone."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(prompts[i], params, use_tqdm=False, lora_request=requests[i])[0].outputs[0]
    return len(out.token_ids), time.perf_counter() - start


def measure_round(engines: dict, order: list[str]) -> dict[str, dict]:
    """The batched runs, then the single-stream requests, the engines alternating run by run (request by request),
    each pass in the reverse order of the one before (a run takes 2-3 s: the machine's speed, which moves by up to
    2x within minutes, moves less between neighbours than between engines' whole turns)."""
    result: dict[str, dict] = {name: {"batched_runs_tok_s": []} for name in order}
    for i in range(BATCHED):
        for name in (order if i % 2 == 0 else order[::-1]):
            result[name]["batched_runs_tok_s"].append(batched(*engines[name]))
    each: dict[str, list[tuple[int, float]]] = {name: [] for name in order}
    for i in range(SINGLE):
        for name in (order if i % 2 == 0 else order[::-1]):
            each[name].append(single(*engines[name], i))
    for name, runs in each.items():
        batched_runs = result[name]["batched_runs_tok_s"]
        result[name]["batched_tok_s"] = len(batched_runs) / sum(1 / x for x in batched_runs)  # tokens / time
        result[name]["single_tok_s"] = sum(n for n, _ in runs) / sum(s for _, s in runs)
        result[name]["single_requests_tok_s"] = [n / s for n, s in runs]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lora-dtypes", default="auto", help="comma-separated lora_dtype values, an engine each")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    dtypes = args.lora_dtypes.split(",")
    names = {"base": None, **{"lora" if d == "auto" else f"lora_{d}": d for d in dtypes}}
    engines = {name: build(d) for name, d in names.items()}
    for llm, prompts, requests in engines.values():  # every bucket and code path once, before timing
        batched(llm, prompts[:4], requests[:4])
        single(llm, prompts, requests, 0)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    order = list(names)
    for r in range(args.rounds):
        turn = order[r % len(order):] + order[:r % len(order)]  # each engine first in turn
        for name, figures in measure_round(engines, turn).items():
            runs[name].append(figures)
            print(f"round {r + 1} {name}: {figures}", flush=True)
    keys = ("batched_tok_s", "single_tok_s")
    med = {name: {k: statistics.median(x[k] for x in rs) for k in keys} for name, rs in runs.items()}
    ratios = {name: {k: med[name][k] / med["base"][k] for k in keys} for name in names if name != "base"}
    for name in ratios:  # each run against the plain engine's run of it next to it, over every round
        for key, runs_key in (("batched", "batched_runs_tok_s"), ("single", "single_requests_tok_s")):
            pairs = [mine / plain for rm, rb in zip(runs[name], runs["base"], strict=True)
                     for mine, plain in zip(rm[runs_key], rb[runs_key], strict=True)]
            ratios[name][f"{key}_pairs_median"] = statistics.median(pairs)
    result = {"machine": machine.describe(), "rounds": args.rounds, "lora_dtypes": dtypes, "runs": runs,
              "median": med, "ratios": ratios}
    loras = [n for n in names if n != "base"]
    print("\n| workload | base tok/s | " + " | ".join(f"{n} tok/s | ratio" for n in loras) + " |")
    print("|---|---|" + "---|---|" * len(loras))
    for k, label in (("batched_tok_s", f"{STREAMS} streams (four adapters mixed)"),
                     ("single_tok_s", "single stream (with an adapter)")):
        cells = " | ".join(f"{med[n][k]:.1f} | {ratios[n][k]:.2f}x" for n in loras)
        print(f"| {label} | {med['base'][k]:.1f} | {cells} |")
    for key, label in (("batched", "batched, median of run pairs"),
                       ("single", "single stream, median of request pairs")):
        print(f"{label}: " + ", ".join(f"{n} {ratios[n][key + '_pairs_median']:.2f}x" for n in loras))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
