"""Offline throughput on the shared peer workload (benchmarks/peer_workload.json, a copy of
../shared/peers/workload.json): 32 prompts of 128 tokens, 128 new tokens each, greedy, EOS ignored; and a
single stream (prompt 0, 128 new tokens). Peers measured side by side in the same run: HF transformers
(float32, padded batch generate) when torch is installed, and llama.cpp's Python bindings when installed;
each engine runs in its own process, one after the other.

    python benchmarks/offline.py [--rounds 2] [--no-peers] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKLOAD = Path(__file__).with_name("peer_workload.json")


def run_jaxllm(workload: dict, rounds: int) -> dict:
    from jaxllm import LLM, SamplingParams

    # float32 weights (the GGUF dequantized), as before quantized serving: benchmarks/quantized.py times those
    llm = LLM(preset="smollm2-cpu", quantization="none", max_num_seqs=32, max_num_batched_tokens=512, num_pages=640,
              max_model_len=1024)
    gen = workload["gen_len"]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    batch = [{"prompt_token_ids": workload["prompts"][i]} for i in workload["batch_prompt_indices"]]
    single = workload["prompts"][workload["single_stream_prompt_index"]]
    llm.generate(batch[:2], params, use_tqdm=False)  # touch every code path once
    batch_tps, decode_tps, ttfts = [], [], []
    engine = llm.engine
    for r in range(rounds):
        engine.block_manager.page_of_hash.clear()  # no prefix-cache hits across rounds
        engine.block_manager.hash_of_page.clear()
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == gen for o in outs)
        batch_tps.append(len(batch) * gen / elapsed)
        engine.block_manager.page_of_hash.clear()
        engine.block_manager.hash_of_page.clear()
        start = time.perf_counter()
        engine.add_request(f"single-{r}", single, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        end = time.perf_counter()
        ttfts.append(first - start)
        decode_tps.append((gen - 1) / (end - first))
    return {"batch_tok_s": statistics.median(batch_tps), "single_tok_s": statistics.median(decode_tps),
            "ttft_s": statistics.median(ttfts), "rounds": rounds}


def run_transformers(workload: dict) -> dict | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    from jaxllm.loading.embedded import embedded_model_path

    path = embedded_model_path()
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    gen = workload["gen_len"]
    prompts = torch.tensor([workload["prompts"][i] for i in workload["batch_prompt_indices"]])  # all 128 long
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=gen,
                       min_new_tokens=gen)
        batch = len(prompts) * gen / (time.perf_counter() - start)
        single = torch.tensor([workload["prompts"][workload["single_stream_prompt_index"]]])
        start = time.perf_counter()
        model.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=1)
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(single, attention_mask=torch.ones_like(single), do_sample=False, max_new_tokens=gen,
                       min_new_tokens=gen)
        single_tps = (gen - 1) / (time.perf_counter() - start - ttft)
    return {"batch_tok_s": batch, "single_tok_s": single_tps, "ttft_s": ttft}


def run_llama_cpp(workload: dict) -> dict | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    from jaxllm.loading.embedded import embedded_model_path

    llm = llama_cpp.Llama(str(embedded_model_path()), n_ctx=512, n_threads=2, verbose=False)
    gen = workload["gen_len"]
    prompt = workload["prompts"][workload["single_stream_prompt_index"]]
    start = time.perf_counter()
    first = None
    for i, _ in enumerate(llm.generate(prompt, temp=0.0)):
        first = first or time.perf_counter()
        if i + 1 == gen:
            break
    end = time.perf_counter()
    return {"single_tok_s": (gen - 1) / (end - first), "ttft_s": first - start,
            "note": "Q4_1 GGUF as shipped; batched figure: see ../shared/peers (llama-server, 32 slots)"}


RUNNERS = {"jaxllm": run_jaxllm, "transformers": run_transformers, "llama.cpp": run_llama_cpp}


def run_isolated(name: str, rounds: int) -> dict | None:
    """Each engine in its own process: their thread pools (XLA, numba's OpenMP, torch's OpenMP) must not share
    the two cores or each other's settings (torch ran 6x slower after jaxllm in one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--engine", name, "--rounds", str(rounds), "--json", str(out)],
                       check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--engine", choices=sorted(RUNNERS), help=argparse.SUPPRESS)  # one engine, in this process
    args = p.parse_args()
    workload = json.loads(WORKLOAD.read_text())
    if args.engine:
        runner = RUNNERS[args.engine]
        result = runner(workload, args.rounds) if args.engine == "jaxllm" else runner(workload)
        Path(args.json).write_text(json.dumps(result))
        return
    names = ["jaxllm"] if args.no_peers else list(RUNNERS)
    results = {name: run_isolated(name, args.rounds) for name in names}
    ours = results["jaxllm"]
    print(f"{'engine':14s} {'batch 32 tok/s':>15s} {'single tok/s':>13s} {'TTFT s':>8s}")
    for name, r in results.items():
        if r:
            print(f"{name:14s} {r.get('batch_tok_s', float('nan')):15.1f} {r['single_tok_s']:13.1f} "
                  f"{r['ttft_s']:8.2f}")
    for name in ("transformers", "llama.cpp"):
        r = results.get(name)
        if r and "batch_tok_s" in r:
            print(f"jaxllm / {name}: batch {ours['batch_tok_s'] / r['batch_tok_s']:.2f}x, "
                  f"single {ours['single_tok_s'] / r['single_tok_s']:.2f}x")
        elif r:
            print(f"jaxllm / {name}: single {ours['single_tok_s'] / r['single_tok_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
