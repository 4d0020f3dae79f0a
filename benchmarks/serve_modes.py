"""Serve modes side by side, same machine, same run, alternating each round: the default server (the engine in
the one gevent worker) and two API workers sharing an engine-core process (JAXLLM_API_SERVERS=2), both on the
`smollm2-cpu` preset:

- single stream: one streaming request of 128 new tokens (EOS banned), decode tok/s after the first token (the
  best of 3 requests);
- rate inf: `benchmarks/serve.py`'s run (32 prompts of ~128 tokens x 128 new tokens, all at once), output tok/s;
- /health latency while that load runs (p50 / p99), polled every 20 ms from a separate process.

    python benchmarks/serve_modes.py [--rounds 2] [--json benchmarks/results/serve_modes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import peers
import serve
import workload

ROOT = Path(__file__).resolve().parents[1]
MODES = {"in-process": {}, "2 API workers + engine core": {"JAXLLM_API_SERVERS": "2"}}


def single_stream(url: str, tokens: int = 128, tries: int = 3) -> float:
    prompt = workload.load()["texts"][0]
    best = 0.0
    for i in range(tries):
        r = serve.one_request(url, None, f"[single-{time.time()}-{i}] {prompt}", tokens, None, eos_id=2)
        best = max(best, (r["tokens"] - 1) / (r["e2e"] - r["ttft"]))
    return best


def under_load(url: str, tag: str) -> tuple[dict, dict]:
    """serve.py's rate-inf run, and /health latencies polled meanwhile."""
    poller = subprocess.Popen([sys.executable, "-m", "tests.server.health_poller", url], cwd=ROOT, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert poller.stdout.readline().strip() == "ready"
    args = SimpleNamespace(base_url=url, model=None, api_key=None, num_prompts=32, max_tokens=128, eos_id=2,
                           max_concurrency=None, tag=tag)
    result = serve.run(args, float("inf"))
    out, _ = poller.communicate("", timeout=60)
    health = json.loads(out.strip().splitlines()[-1])
    lat = sorted(health["latencies"])
    return result, {"p50_ms": 1e3 * statistics.median(lat), "p99_ms": 1e3 * lat[int(0.99 * (len(lat) - 1))],
                    "polls": len(lat), "failures": len(health["failures"])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for rnd in range(args.rounds):
        order = list(MODES) if rnd % 2 == 0 else list(MODES)[::-1]
        for mode in order:
            port = peers.free_port()
            env = {**os.environ, **MODES[mode], "JAXLLM_BIND": f"127.0.0.1:{port}", "JAXLLM_LOG_LEVEL": "warning"}
            with peers.running([sys.executable, "-m", "gunicorn", "server.app:app"], port, timeout=900, cwd=ROOT,
                               env=env) as url:
                single = single_stream(url)
                load, health = under_load(url, f"modes-{time.time():.0f}-{rnd}")
            assert load["failed"] == 0, load["failures"]
            row = {"single_tok_s": single, "rate_inf_output_tok_s": load["output_tok_s"],
                   "ttft_p99_s": load["ttft_s"]["p99"], "health_p50_ms": health["p50_ms"],
                   "health_p99_ms": health["p99_ms"], "health_polls": health["polls"],
                   "health_failures": health["failures"]}
            runs[mode].append(row)
            print(f"round {rnd} {mode:28s} single {single:6.1f} tok/s | rate inf {load['output_tok_s']:6.1f} tok/s | "
                  f"/health p50 {health['p50_ms']:6.1f} p99 {health['p99_ms']:6.1f} ms ({health['polls']} polls)",
                  flush=True)
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    base, multi = (summary[m] for m in MODES)
    ratios = {"single": multi["single_tok_s"] / base["single_tok_s"],
              "rate_inf": multi["rate_inf_output_tok_s"] / base["rate_inf_output_tok_s"]}
    print(f"\nmedians over {args.rounds} rounds:")
    for m, s in summary.items():
        print(f"  {m:28s} single {s['single_tok_s']:6.1f} tok/s | rate inf {s['rate_inf_output_tok_s']:6.1f} tok/s | "
              f"/health p99 {s['health_p99_ms']:6.1f} ms")
    print(f"2 API workers / in-process: single stream {ratios['single']:.3f}x, rate inf {ratios['rate_inf']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "summary": summary, "ratios": ratios,
                                               "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
