"""Speculative decoding's speed on the embedded SmolLM2 (`LLM()` defaults, the `smollm2-cpu` preset), the same
engine with and without it, each in its own process, alternating over rounds: one request at a time, output
tokens per second over the whole request (prefill included) on input-grounded prompts (repeat, rewrite, extract,
correct a given text) and on open questions; and 16 grounded streams at once. Greedy, 256 new tokens at most.
Prompts: benchmarks/data/speculative_prompts.json.

    python benchmarks/speculative.py [--rounds 3] [--k 7] [--lookup-max 4] [--lookup-min 2] [--json out.json]
        [--draft-budgets all,step_cost]

--draft-budgets: an ngram engine per `draft_budget` value, in the same rounds (the first is the headline's).
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

import machine

PROMPTS = json.loads(Path(__file__).with_name("data").joinpath("speculative_prompts.json").read_text())
MAX_TOKENS = 256
CONCURRENT = 16


def run_engine(spec: dict | None) -> dict:
    from jaxllm import LLM, SamplingParams

    llm = LLM(speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    system = [{"role": "system", "content": PROMPTS["system"]}]
    chats = {"grounded": [system + [{"role": "user", "content": p}] for p in PROMPTS["grounded"]],
             "open": [[{"role": "user", "content": p}] for p in PROMPTS["open"]]}
    llm.chat(chats["open"][:1], params, use_tqdm=False)  # every code path once
    result = {}
    for kind, convs in chats.items():
        tokens, seconds = 0, 0.0
        for conv in convs:
            start = time.perf_counter()
            out = llm.chat([conv], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
        result[f"{kind}_tok_s"] = tokens / seconds
        result[f"{kind}_tokens"] = tokens
    streams = [chats["grounded"][i % len(chats["grounded"])] for i in range(CONCURRENT)]
    start = time.perf_counter()
    outs = llm.chat(streams, params, use_tqdm=False)
    result["concurrent_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    if llm.spec_decode_stats is not None:
        result["acceptance_rate"] = llm.spec_decode_stats.acceptance_rate
        result["mean_acceptance_length"] = llm.spec_decode_stats.mean_acceptance_length
    return result


def run_isolated(spec: dict | None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--engine", json.dumps(spec), "--json", str(out)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens (1 + k a token bucket: no padding rows)")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--draft-budgets", default="all", help="comma-separated draft_budget values: an engine each")
    p.add_argument("--engine", help=argparse.SUPPRESS)  # one run, here: the speculative config's JSON
    args = p.parse_args()
    if args.engine:
        Path(args.json).write_text(json.dumps(run_engine(json.loads(args.engine))))
        return
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    budgets = args.draft_budgets.split(",")
    engines = {"plain": None, "ngram": {**spec, "draft_budget": budgets[0]}}
    engines |= {f"ngram {b}": {**spec, "draft_budget": b} for b in budgets[1:]}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, config in engines.items():
            runs[name].append(run_isolated(config))
            print(f"round {r}: {name} {runs[name][-1]}", flush=True)
    metrics = ("grounded_tok_s", "open_tok_s", "concurrent_tok_s")
    summary = {name: {m: statistics.median(x[m] for x in rs) for m in metrics} for name, rs in runs.items()}
    ratios = {m: summary["ngram"][m] / summary["plain"][m] for m in metrics}
    more = {name: {m: summary[name][m] / summary["plain"][m] for m in metrics} for name in list(engines)[2:]}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds; ngram: {spec}\n{machine.line(host)}")
    print(f"{'':10s} {'grounded tok/s':>15s} {'open tok/s':>11s} {f'{CONCURRENT} grounded tok/s':>19s}")
    for name, m in summary.items():
        print(f"{name:10s} {m['grounded_tok_s']:15.1f} {m['open_tok_s']:11.1f} {m['concurrent_tok_s']:19.1f}")
    for name, r in ({"ratio": ratios} | {f"{name} ratio": r for name, r in more.items()}).items():
        print(f"{name:10s} {r['grounded_tok_s']:14.2f}x {r['open_tok_s']:10.2f}x {r['concurrent_tok_s']:18.2f}x")
    machine.save(args.json, host, rounds=args.rounds, speculative_config=engines["ngram"], summary=summary,
                 ratios=ratios, other_ratios=more, runs=runs)


if __name__ == "__main__":
    main()
