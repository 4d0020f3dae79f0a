"""The serving sweep with `jaxllm bench serve` (vLLM's `bench serve`: random prompts of --input-len tokens by the
model's tokenizer, --output-len tokens each with ignore_eos, Poisson arrivals at each rate, then all at once)
against jaxllm's server (`jaxllm serve` with its defaults: the embedded model, the `smollm2-cpu` preset) and
llama.cpp's `llama-server -t 2 -np 16 -c 5120` (parallel slots, continuous batching) on the F16 GGUF, side by
side: one server at a time, alternating over rounds, every rate's prompts new to the server (a seed per round and
rate: no warm prompt cache). Prints the per-rate medians over rounds and jaxllm's ratios; writes the raw results.

    python benchmarks/serve_peers.py [--rounds 2] [--sweep 0.5,1,2,inf] [--peer-types F16]
        [--json benchmarks/results/serve_peers.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import machine
import peers

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "p99_itl_ms")


def jaxllm_server(port: int):
    """`jaxllm serve` with its defaults (a context manager yielding its URL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXLLM_")}
    return peers.running([sys.executable, "-m", "jaxllm", "serve", "--port", str(port), "--host", "127.0.0.1",
                          "--uvicorn-log-level", "warning"], port, timeout=600, cwd=ROOT, env=env)


def bench(url: str, label: str, rate: float, seed: int, args, tokenizer: str) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "jaxllm", "bench", "serve", "--base-url", url, "--tokenizer", tokenizer,
               "--dataset-name", "random", "--random-input-len", str(args.input_len), "--random-output-len",
               str(args.output_len), "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
               "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--label", label, "--save-result",
               "--result-dir", out, "--result-filename", "r.json", "--percentile-metrics", "ttft,tpot,itl,e2el"]
        run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"jaxllm bench serve failed against {label}: {run.stderr[-2000:]}")
        result = json.loads((Path(out) / "r.json").read_text())
    for key in ("itls", "generated_texts"):
        result.pop(key)  # bulky; the summary keeps what the tables use
    if result["completed"] != args.num_prompts or set(result["output_lens"]) != {args.output_len}:
        raise RuntimeError(f"{label} at {rate}: {result['completed']} completed, output lengths "
                           f"{sorted(set(result['output_lens']))}, errors {[e for e in result['errors'] if e][:3]}")
    print(f"{label:22s} rate {rate:>5} | {result['output_throughput']:7.1f} tok/s | TTFT med "
          f"{result['median_ttft_ms']:6.0f} p99 {result['p99_ttft_ms']:6.0f} ms | TPOT med "
          f"{result['median_tpot_ms']:5.1f} ms | ITL p99 {result['p99_itl_ms']:6.1f} ms", flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep", default="0.5,1,2,inf")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--peer-types", default="F16", help="GGUF types llama-server serves (F32,F16,Q8_0,Q4_1)")
    p.add_argument("--json")
    args = p.parse_args()
    peer = peers.peer_dir()
    if peer is None:
        raise SystemExit(f"no llama.cpp peers: {peers.BUILD} is missing")
    tokenizer = peers.gguf(peer, "Q4_1")  # the embedded model's file: both servers' tokenizer
    rates = [float(x) for x in args.sweep.split(",")]
    labels = ["jaxllm"] + [f"llama-server {t}" for t in args.peer_types.split(",")]
    runs: dict[str, list[list[dict]]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels:
            port = peers.free_port()
            server = jaxllm_server(port) if label == "jaxllm" else \
                peers.server(peer, peers.gguf(peer, label.split()[-1]), slots=16, ctx=5120, port=port)
            with server as url:
                bench(url, label, 1.0, 10_000 + r, argparse.Namespace(**{**vars(args), "num_prompts": 2}),
                      tokenizer)  # warm-up: first connections and first steps
                runs[label].append([bench(url, label, rate, 100 * r + i, args, tokenizer)
                                    for i, rate in enumerate(rates)])
    summary = {label: [{"request_rate": rate, **{k: statistics.median(rs[i][k] for rs in rounds) for k in KEYS}}
                       for i, rate in enumerate(rates)] for label, rounds in runs.items()}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds; {machine.line(host)}")
    for label, rows in summary.items():
        for row in rows:
            print(f"{label:22s} {row['request_rate']:5} {row['output_throughput']:7.1f} tok/s  TTFT "
                  f"{row['median_ttft_ms']:6.0f} / {row['p99_ttft_ms']:6.0f} ms  TPOT {row['median_tpot_ms']:5.1f} ms")
    for label in labels[1:]:
        for a, b in zip(summary["jaxllm"], summary[label], strict=True):
            tput = a["output_throughput"] / b["output_throughput"]
            ttft, tpot = a["p99_ttft_ms"] / b["p99_ttft_ms"], a["median_tpot_ms"] / b["median_tpot_ms"]
            print(f"jaxllm / {label} at {a['request_rate']}: tok/s {tput:.2f}x, p99 TTFT {ttft:.2f}x, "
                  f"median TPOT {tpot:.2f}x")
    machine.save(args.json, host, rates=rates, args=vars(args), summary=summary, runs=runs)


if __name__ == "__main__":
    main()
