"""Load generator for any OpenAI-compatible server (jaxllm, llama.cpp's server, vLLM...).

Streams /v1/completions requests with Poisson arrivals at --request-rate (or all at once with "inf"),
optionally capped at --max-concurrency, and reports request throughput, output tokens/s and TTFT / TPOT /
ITL / E2E latency (mean, median, p99). Prompts: the shared peer workload's texts (128-token chat prompts),
each rate's made distinct by a leading tag (run, rate, index) so that no rate answers from a prompt cache the
previous one warmed; every request generates exactly --max-tokens tokens (EOS banned through logit_bias, which
every OpenAI-compatible server supports). --sweep runs several rates and saves a PNG of the curves.
benchmarks/serve_peers.py runs this sweep against jaxllm and llama.cpp's llama-server side by side.

    python benchmarks/serve.py --base-url http://127.0.0.1:8000 --label jaxllm --sweep 0.5,1,2,inf \\
        --json out/jaxllm.json --plot out/sweep.png [--compare out/llama.cpp.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import workload


def one_request(base_url: str, model: str | None, prompt: str, max_tokens: int, api_key: str | None,
                eos_id: int, arrival: float | None = None) -> dict:
    """arrival: when the request arrived (before any client-side concurrency limit); latencies count from it."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logit_bias": {str(eos_id): -100}}
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = arrival if arrival is not None else time.perf_counter()
    arrivals = []
    with requests.post(base_url + "/v1/completions", json=body, headers=headers, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    return {"start": start, "ttft": arrivals[0] - start if arrivals else None, "e2e": end - start,
            "chunks": len(arrivals), "itl": [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)],
            "tokens": max_tokens}


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    v = sorted(values)
    return {"mean": statistics.fmean(v), "median": statistics.median(v), "p99": v[min(len(v) - 1, int(0.99 * len(v)))]}


def run(args, rate: float) -> dict:
    texts = workload.load()["texts"]
    tag = f"{getattr(args, 'tag', '') or 'run'}-{rate}"
    prompts = [f"[{tag}-{i}] {texts[i % len(texts)]}" for i in range(args.num_prompts)]
    rng = random.Random(0)
    results: list[dict] = []
    lock = threading.Lock()
    limit = threading.Semaphore(args.max_concurrency or len(prompts))

    failures: list[str] = []

    def task(prompt, arrival):
        try:
            with limit:
                r = one_request(args.base_url, args.model, prompt, args.max_tokens, args.api_key, args.eos_id,
                                arrival)
            if r["chunks"] < args.max_tokens * 0.9:  # cut short: count as failed, not as fast
                raise RuntimeError(f"stream ended after {r['chunks']} chunks")
        except Exception as e:  # noqa: BLE001 - reported, never silently dropped
            with lock:
                failures.append(repr(e))
            return
        with lock:
            results.append(r)

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        for prompt in prompts:
            pool.submit(task, prompt, time.perf_counter())
            if rate != float("inf"):
                time.sleep(rng.expovariate(rate))
    duration = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    tpot = [(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in results if r["ttft"] is not None and r["tokens"] > 1]
    return {
        "request_rate": rate, "num_prompts": len(prompts), "completed": len(results), "failed": len(failures),
        "failures": failures[:5], "duration_s": duration,
        "request_throughput": len(results) / duration, "output_tok_s": tokens / duration,
        "ttft_s": stats([r["ttft"] for r in results if r["ttft"] is not None]), "tpot_s": stats(tpot),
        "itl_s": stats([x for r in results for x in r["itl"]]), "e2e_s": stats([r["e2e"] for r in results]),
    }


def print_row(label: str, r: dict) -> None:
    ms = lambda s: s["median"] * 1e3  # noqa: E731
    p99 = lambda s: s["p99"] * 1e3  # noqa: E731
    print(f"{label:10s} rate {r['request_rate']:>5} | {r['request_throughput']:5.2f} req/s "
          f"{r['output_tok_s']:7.1f} tok/s | TTFT med {ms(r['ttft_s']):7.0f} p99 {p99(r['ttft_s']):7.0f} ms | "
          f"TPOT med {ms(r['tpot_s']):6.1f} | ITL med {ms(r['itl_s']):6.1f} p99 {p99(r['itl_s']):6.1f} | "
          f"E2E med {r['e2e_s']['median']:6.2f} s | {r['completed']}/{r['num_prompts']} ok")


def plot(series: dict[str, list[dict]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for label, runs in series.items():
        finite = [r for r in runs if r["request_rate"] != float("inf")]
        x = [r["request_rate"] for r in finite]
        axes[0].plot(x, [r["output_tok_s"] for r in finite], "o-", label=label)
        axes[1].plot(x, [r["ttft_s"]["median"] * 1e3 for r in finite], "o-", label=label)
        axes[2].plot(x, [r["tpot_s"]["median"] * 1e3 for r in finite], "o-", label=label)
    for ax, title in zip(axes, ["output tokens/s", "median TTFT (ms)", "median TPOT (ms)"], strict=True):
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model")
    p.add_argument("--api-key")
    p.add_argument("--label", default="server")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--eos-id", type=int, default=2, help="token id banned with logit_bias (SmolLM2: 2)")
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--max-concurrency", type=int)
    p.add_argument("--sweep", help="comma-separated request rates (inf allowed)")
    p.add_argument("--tag", default=f"{time.time():.0f}", help="prefix that makes this run's prompts distinct")
    p.add_argument("--json", help="save results here")
    p.add_argument("--plot", help="save a PNG of the sweep here")
    p.add_argument("--compare", nargs="*", default=[], help="JSON results of other servers to plot beside")
    args = p.parse_args()
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else [args.request_rate]
    one_request(args.base_url, args.model, "Hello", 4, args.api_key, args.eos_id)  # warm the connection
    runs = []
    for rate in rates:
        runs.append(run(args, rate))
        print_row(args.label, runs[-1])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"label": args.label, "runs": runs}, indent=1))
    if args.plot:
        series = {args.label: runs}
        for other in args.compare:
            data = json.loads(Path(other).read_text())
            series[data["label"]] = data["runs"]
        plot(series, args.plot)


if __name__ == "__main__":
    main()
