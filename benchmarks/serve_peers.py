"""The serving sweep (benchmarks/serve.py: 16 streaming /v1/completions requests of the peer workload's
128-token prompts, 128 tokens each, Poisson arrivals at each rate, then all at once) against jaxllm's server
(`gunicorn server.app:app`, its defaults: the embedded model, the `smollm2-cpu` preset) and llama.cpp's
`llama-server -t 2 -np 16 -c 5120` (parallel slots, continuous batching) on the F16 GGUF, side by side: one
server at a time, alternating over rounds, every rate's prompts new to the server (no warm prompt cache).
Prints the per-rate medians over rounds and the ratios the issue's acceptance names; writes the raw runs.

    python benchmarks/serve_peers.py [--rounds 2] [--sweep 0.5,1,2,inf] [--peer-types F16]
        [--json benchmarks/results/serve_peers.json] [--plot benchmarks/results/serve_sweep.png]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import peers
import serve

ROOT = Path(__file__).resolve().parents[1]


def jaxllm_server(port: int):
    """`gunicorn server.app:app` with its defaults (a context manager yielding its URL)."""
    env = {**os.environ, "JAXLLM_BIND": f"127.0.0.1:{port}", "JAXLLM_LOG_LEVEL": "warning"}
    return peers.running([sys.executable, "-m", "gunicorn", "server.app:app"], port, timeout=600, cwd=ROOT,
                         env=env)


def sweep(url: str, label: str, rates: list[float], tag: str, num_prompts: int, max_tokens: int) -> list[dict]:
    args = argparse.Namespace(base_url=url, model=None, api_key=None, num_prompts=num_prompts, max_tokens=max_tokens,
                              eos_id=2, max_concurrency=None, tag=tag)
    serve.one_request(url, None, "Hello", 4, None, 2)  # warm the connection and the first step
    runs = []
    for rate in rates:
        runs.append(serve.run(args, rate))
        serve.print_row(label, runs[-1])
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--sweep", default="0.5,1,2,inf")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--peer-types", default="F16", help="GGUF types llama-server serves (F32,F16,Q8_0,Q4_1)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args()
    peer = peers.peer_dir()
    if peer is None:
        raise SystemExit(f"no llama.cpp peers: {peers.BUILD} is missing")
    rates = [float(x) for x in args.sweep.split(",")]
    labels = ["jaxllm"] + [f"llama-server {t}" for t in args.peer_types.split(",")]
    runs: dict[str, list[list[dict]]] = {label: [] for label in labels}
    stamp = f"{time.time():.0f}"
    for r in range(args.rounds):
        for label in labels:
            tag = f"{stamp}-{r}"
            port = peers.free_port()
            server = jaxllm_server(port) if label == "jaxllm" else \
                peers.server(peer, peers.gguf(peer, label.split()[-1]), slots=16, ctx=5120, port=port)
            with server as url:
                runs[label].append(sweep(url, label, rates, tag, args.num_prompts, args.max_tokens))
    summary = {}
    for label, rounds in runs.items():
        summary[label] = []
        for i, rate in enumerate(rates):
            at = [rs[i] for rs in rounds]
            summary[label].append({"request_rate": rate, "failed": sum(x["failed"] for x in at),
                                   "output_tok_s": statistics.median(x["output_tok_s"] for x in at),
                                   "ttft_p99_s": statistics.median(x["ttft_s"]["p99"] for x in at),
                                   "ttft_median_s": statistics.median(x["ttft_s"]["median"] for x in at),
                                   "tpot_median_s": statistics.median(x["tpot_s"]["median"] for x in at)})
    print(f"\nmedians over {args.rounds} rounds")
    print(f"{'server':18s} {'rate':>5s} {'tok/s':>7s} {'TTFT med':>9s} {'TTFT p99':>9s} {'TPOT med':>9s}")
    for label, rows in summary.items():
        for row in rows:
            print(f"{label:18s} {row['request_rate']:5} {row['output_tok_s']:7.1f} {row['ttft_median_s'] * 1e3:7.0f}ms"
                  f" {row['ttft_p99_s'] * 1e3:7.0f}ms {row['tpot_median_s'] * 1e3:7.1f}ms  failed {row['failed']}")
    ours = summary["jaxllm"]
    for label in labels[1:]:
        for a, b in zip(ours, summary[label], strict=True):
            print(f"jaxllm / {label} at {a['request_rate']}: tok/s {a['output_tok_s'] / b['output_tok_s']:.2f}x, "
                  f"p99 TTFT {a['ttft_p99_s'] / b['ttft_p99_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "summary": summary, "runs": runs}, indent=1))
    if args.plot:
        serve.plot({label: rounds[-1] for label, rounds in runs.items()}, args.plot)


if __name__ == "__main__":
    main()
