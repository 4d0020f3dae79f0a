"""Async scheduling on and off, and llama.cpp beside, on the same GGUF file: the peer workload's single stream
(prompt 0, 128 new tokens, greedy, EOS ignored; decode tok/s after the first token, the best of 3 runs in a process)
with `async_scheduling=True` and `False`, each in its own process, alternating; `llama-bench -t 2 -p 0 -n 128` in the
same rounds. Medians over rounds.

    python benchmarks/async_scheduling.py [--rounds 4] [--file Q8_0]
        [--json benchmarks/results/async_scheduling_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import peers
import workload


def single_stream(model: str, async_scheduling: bool, runs: int = 3) -> float:
    from jaxllm import LLM, SamplingParams

    llm = LLM(model, preset="smollm2-cpu", num_pages=640, max_model_len=1024, async_scheduling=async_scheduling)
    engine, w = llm.engine, workload.load()
    params = SamplingParams(temperature=0, max_tokens=w["gen_len"], ignore_eos=True)
    prompt = w["prompts"][w["single_stream_prompt_index"]]
    best = 0.0
    for r in range(runs + 1):  # the first run warms up
        engine.block_manager.page_of_hash.clear()
        engine.block_manager.hash_of_page.clear()
        engine.add_request(f"single-{r}", prompt, params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            first = first or time.perf_counter()
        if r:
            best = max(best, (w["gen_len"] - 1) / (time.perf_counter() - first))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--file", default="Q8_0", help="the peers' GGUF: Q8_0, Q4_1, F16, F32")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", choices=["on", "off"], help=argparse.SUPPRESS)  # a child process's single run
    args = ap.parse_args()
    folder = peers.peer_dir()
    model = peers.gguf(folder, args.file)
    if args.one:
        print(json.dumps(single_stream(model, args.one == "on")))
        return
    runs: dict[str, list[float]] = {"on": [], "off": [], "llama.cpp": []}
    for r in range(args.rounds):
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--file", args.file, "--one", mode], capture_output=True,
                                 text=True, check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        runs["llama.cpp"].append(peers.single_stream(folder, model))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    result = {"file": args.file, "median_tok_s": med, "on_over_off": med["on"] / med["off"],
              "on_over_llama_cpp": med["on"] / med["llama.cpp"],
              "rounds_on_ahead_of_off": sum(a > b for a, b in zip(runs["on"], runs["off"], strict=True)),
              "runs": runs}
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
