"""Speculative decoding's speed on the embedded SmolLM2 (`LLM()` defaults, the `smollm2-cpu` preset), the same
engine with and without it, in one process: one request at a time, output tokens per second over the whole
request (prefill included) on input-grounded prompts (repeat, rewrite, extract, correct a given text) and on open
questions, the engines alternating request by request; and 16 grounded streams at once, the engines in turn.
Each round starts every engine with an empty prefix cache (`LLM.reset_prefix_cache`), as a fresh process would.
Greedy, 256 new tokens at most. Prompts: benchmarks/data/speculative_prompts.json. How much of each grounded answer
the text holds is reported beside it ("quoted": the share of the plain engine's answer tokens inside a run of
`QUOTE_RUN` tokens found in the prompt): a small model sometimes answers a grounded prompt with words of its own.

    python benchmarks/speculative.py [--rounds 3] [--k 7] [--lookup-max 4] [--lookup-min 2] [--json out.json]
        [--draft-budgets all,step_cost] [--also '{"prompt_lookup_min": 1}' ...]

--draft-budgets: an ngram engine per `draft_budget` value, in the same rounds (the first is the headline's);
--also: one more ngram engine with these fields over the headline's config (repeatable).
Reported: medians over rounds of each engine's tok/s, and the medians of the per-round ratios to the plain engine
beside it (each round's engines ran interleaved, so its ratio is the one that means something on a machine whose
speed drifts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import machine

PROMPTS = json.loads(Path(__file__).with_name("data").joinpath("speculative_prompts.json").read_text())
MAX_TOKENS = 256
QUOTE_RUN = 4
CONCURRENT = 16
METRICS = ("grounded_tok_s", "open_tok_s", "concurrent_tok_s")


def conversations() -> dict[str, list[list[dict]]]:
    system = [{"role": "system", "content": PROMPTS["system"]}]
    return {"grounded": [system + [{"role": "user", "content": p}] for p in PROMPTS["grounded"]],
            "open": [[{"role": "user", "content": p}] for p in PROMPTS["open"]]}


def quoted(prompt: list[int], answer: list[int], run: int = QUOTE_RUN) -> float:
    """The share of `answer`'s tokens inside a run of `run` tokens that `prompt` holds too."""
    grams = {tuple(prompt[i:i + run]) for i in range(len(prompt) - run + 1)}
    covered = [False] * len(answer)
    for i in range(len(answer) - run + 1):
        if tuple(answer[i:i + run]) in grams:
            covered[i:i + run] = [True] * run
    return sum(covered) / max(1, len(answer))


def run_round(engines: dict, r: int) -> dict[str, dict]:
    """One round: every engine from an empty prefix cache; the single requests with the engines alternating
    (the order turned each request), then each engine's 16 streams."""
    from jaxllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    names = list(engines)
    for llm in engines.values():
        if not llm.reset_prefix_cache():
            raise RuntimeError("an engine still runs requests")
    result = {name: {} for name in names}
    turn = r
    chats = conversations()
    for kind, convs in chats.items():
        tokens = dict.fromkeys(names, 0)
        seconds = dict.fromkeys(names, 0.0)
        per_prompt = {name: [] for name in names}
        for conv in convs:
            turn += 1
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                start = time.perf_counter()
                request = engines[name].chat([conv], params, use_tqdm=False)[0]
                took = time.perf_counter() - start
                out = request.outputs[0]
                seconds[name] += took
                tokens[name] += len(out.token_ids)
                per_prompt[name].append([len(out.token_ids), round(took, 5),
                                         round(quoted(request.prompt_token_ids, out.token_ids), 3)])
        for name in names:
            result[name] |= {f"{kind}_tok_s": tokens[name] / seconds[name], f"{kind}_tokens": tokens[name],
                             f"{kind}_per_prompt": per_prompt[name]}
    streams = [chats["grounded"][i % len(chats["grounded"])] for i in range(CONCURRENT)]
    for name in names[r % len(names):] + names[:r % len(names)]:
        start = time.perf_counter()
        outs = engines[name].chat(streams, params, use_tqdm=False)
        result[name]["concurrent_tok_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (
            time.perf_counter() - start)
    for name, llm in engines.items():
        if llm.spec_decode_stats is not None:
            stats = llm.spec_decode_stats
            result[name] |= {"acceptance_rate": stats.acceptance_rate,
                             "mean_acceptance_length": stats.mean_acceptance_length,
                             "guessed_steps": stats.num_guessed_steps,
                             "guessed_steps_held": stats.num_guessed_steps_held,
                             "batch_limit": llm.engine.drafter.batch_limit}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=7, help="num_speculative_tokens (1 + k a token bucket: no padding rows)")
    p.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    p.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--draft-budgets", default="all", help="comma-separated draft_budget values: an engine each")
    p.add_argument("--also", action="append", default=[], type=json.loads,
                   help="JSON fields over the headline's ngram config: one more engine (repeatable)")
    args = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    budgets = args.draft_budgets.split(",")
    engines = {"plain": None, "ngram": {**spec, "draft_budget": budgets[0]}}
    engines |= {f"ngram {b}": {**spec, "draft_budget": b} for b in budgets[1:]}
    engines |= {f"ngram {json.dumps(fields)}": {**engines["ngram"], **fields} for fields in args.also}
    from jaxllm import LLM, SamplingParams

    llms = {name: LLM(speculative_config=config) for name, config in engines.items()}
    warm = conversations()["open"][:1]
    for llm in llms.values():  # every code path once
        llm.chat(warm, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for name, result in run_round(llms, r).items():
            runs[name].append(result)
            print(f"round {r}: {name} " + " ".join(f"{m} {result[m]:.1f}" for m in METRICS), flush=True)
    metrics = METRICS
    summary = {name: {m: statistics.median(x[m] for x in rs) for m in metrics} for name, rs in runs.items()}

    def paired(name: str) -> dict[str, float]:
        return {m: statistics.median(a[m] / b[m] for a, b in zip(runs[name], runs["plain"], strict=True))
                for m in metrics}
    ratios = paired("ngram")
    more = {name: paired(name) for name in list(engines)[2:]}
    host = machine.describe()
    limits = {name: rs[0]["batch_limit"] for name, rs in runs.items() if "batch_limit" in rs[0]}
    print(f"\nmedians over {args.rounds} rounds (ratios: medians of the rounds' ratios); ngram: {spec}; no drafts "
          f"from batches of (disable_by_batch_size, as resolved): {limits}\n{machine.line(host)}")
    print(f"{'':10s} {'grounded tok/s':>15s} {'open tok/s':>11s} {f'{CONCURRENT} grounded tok/s':>19s}")
    for name, m in summary.items():
        print(f"{name:10s} {m['grounded_tok_s']:15.1f} {m['open_tok_s']:11.1f} {m['concurrent_tok_s']:19.1f}")
    for name, r in ({"ratio": ratios} | {f"{name} ratio": r for name, r in more.items()}).items():
        print(f"{name:10s} {r['grounded_tok_s']:14.2f}x {r['open_tok_s']:10.2f}x {r['concurrent_tok_s']:18.2f}x")
    per_prompt = {}
    for kind in ("grounded", "open"):  # each prompt's tok/s ratio (medians of the rounds'), and how much it quotes
        rows = []
        for i in range(len(runs["plain"][0][f"{kind}_per_prompt"])):
            ratio = statistics.median((a[1] / a[0]) / (b[1] / b[0]) for a, b in zip(
                (r[f"{kind}_per_prompt"][i] for r in runs["plain"]),
                (r[f"{kind}_per_prompt"][i] for r in runs["ngram"]), strict=True))
            plain = runs["plain"][0][f"{kind}_per_prompt"][i]
            rows.append({"tokens": plain[0], "quoted": plain[2], "ratio": ratio})
        per_prompt[kind] = rows
        print(f"{kind} prompts (tokens, quoted, ratio): " + "  ".join(
            f"{r['tokens']} {r['quoted']:.2f} {r['ratio']:.2f}x" for r in rows))
    machine.save(args.json, host, rounds=args.rounds, speculative_config=engines["ngram"], summary=summary,
                 ratios=ratios, other_ratios=more, per_prompt=per_prompt, runs=runs)


if __name__ == "__main__":
    main()
