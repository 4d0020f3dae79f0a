"""Long prompts and long contexts, `LLM()` as a user calls it against `llama-bench` on the same GGUF (the embedded
Q4_1 SmolLM2), 2 threads, engines alternating in every round, each in its own process; medians over rounds.

- prefill: a prompt of N random tokens, one new token (tok/s = N / time); `llama-bench -p N -n 0`;
- decode at depth D: 64 new tokens after a D-token prompt (the prompt is prefilled first and kept in the prefix
  cache: the figure is the decode's alone); `llama-bench -p 0 -n 64 -d D`.

    python benchmarks/long_context.py [--rounds 3] [--prefill 512,2048] [--depths 4096,8064] [--json out.json]

8064, not 8192: the model's context is 8192 tokens, and the decode needs room for its 64 tokens and one more.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
import peers

NEW_TOKENS = 64


def run_jaxllm(prefill: list[int], depths: list[int]) -> dict:
    import numpy as np

    from jaxllm import LLM, SamplingParams

    llm = LLM()
    rng = np.random.default_rng(0)
    vocab = llm.get_tokenizer().vocab_size

    def prompt(n: int) -> list[dict]:  # fresh tokens every time: no prefix-cache hits across measurements
        return [{"prompt_token_ids": rng.integers(100, vocab - 100, n).tolist()}]

    def timed(prompts, tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(prompt(64), 8)  # warm-up
    out = {}
    for n in prefill:
        out[f"prefill {n}"] = n / timed(prompt(n), 1)
    for d in depths:
        p = prompt(d)
        timed(p, 1)  # prefilled, now in the prefix cache
        one = timed(p, 1)
        many = timed(p, 1 + NEW_TOKENS)
        out[f"decode at {d}"] = NEW_TOKENS / (many - one)
    return out


def run_isolated(prefill: list[int], depths: list[int]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--engine", "--prefill", ",".join(map(str, prefill)),
                        "--depths", ",".join(map(str, depths)), "--json", str(out)], check=True)
        return json.loads(out.read_text())


def run_llama(peer: Path, prefill: list[int], depths: list[int]) -> dict:
    bench = str(peer / "bin" / "llama-bench")
    model = peers.gguf(peer, "Q4_1")
    out = {}
    rows = peers.run_tool([bench, "-m", model, "-t", "2", "-p", ",".join(map(str, prefill)), "-n", "0", "-r", "1",
                           "-o", "csv"], peers.BENCH_NO_REPACK)
    for row in csv.DictReader(io.StringIO(rows)):
        out[f"prefill {row['n_prompt']}"] = float(row["avg_ts"])
    rows = peers.run_tool([bench, "-m", model, "-t", "2", "-p", "0", "-n", str(NEW_TOKENS), "-d",
                           ",".join(map(str, depths)), "-r", "1", "-o", "csv"], peers.BENCH_NO_REPACK)
    for row in csv.DictReader(io.StringIO(rows)):
        out[f"decode at {row['n_depth']}"] = float(row["avg_ts"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prefill", default="512,2048")
    p.add_argument("--depths", default="4096,8064")
    p.add_argument("--json")
    p.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)  # one jaxllm run, in this process
    args = p.parse_args()
    prefill = [int(x) for x in args.prefill.split(",") if x]
    depths = [int(x) for x in args.depths.split(",") if x]
    if args.engine:
        Path(args.json).write_text(json.dumps(run_jaxllm(prefill, depths)))
        return
    peer = peers.peer_dir()
    runs: dict[str, list[dict]] = {"jaxllm LLM()": [], "llama.cpp Q4_1": []}
    for r in range(args.rounds):
        runs["jaxllm LLM()"].append(run_isolated(prefill, depths))
        print(f"round {r}: jaxllm {runs['jaxllm LLM()'][-1]}", flush=True)
        runs["llama.cpp Q4_1"].append(run_llama(peer, prefill, depths))
        print(f"round {r}: llama.cpp {runs['llama.cpp Q4_1'][-1]}", flush=True)
    keys = list(runs["jaxllm LLM()"][0])
    summary = {engine: {k: statistics.median(x[k] for x in rs) for k in keys} for engine, rs in runs.items()}
    ratios = {k: summary["jaxllm LLM()"][k] / summary["llama.cpp Q4_1"][k] for k in keys}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds (tok/s)\n{machine.line(host)}")
    print(f"{'':18s} {'jaxllm LLM()':>13s} {'llama.cpp Q4_1':>15s} {'ratio':>7s}")
    for k in keys:
        print(f"{k:18s} {summary['jaxllm LLM()'][k]:13.1f} {summary['llama.cpp Q4_1'][k]:15.1f} {ratios[k]:6.2f}x")
    for cmd in dict.fromkeys(peers.repack_off):
        print(f"ran again with llama.cpp's repack off: {cmd}")
    machine.save(args.json, host, rounds=args.rounds, summary=summary, ratios=ratios, runs=runs,
                 llama_repack_off=sorted(set(peers.repack_off)))


if __name__ == "__main__":
    main()
