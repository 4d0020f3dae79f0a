"""Speculative decoding with a draft model on CPU: SmolLM2's float32 GGUF drafted by its Q4_1 GGUF (the files the
shared build script makes), against the same target without speculation and against llama.cpp's
`llama-speculative` with the same two files and the same k. One request at a time, greedy, up to --max-tokens
new tokens; output tok/s over whole requests, prefill included (llama-speculative: its decoded tokens over its
own encode + decode seconds, model loading excluded as jaxllm's is). Prompts: the open questions and grounded
prompts of benchmarks/data/speculative_prompts.json, in the model's chat template. Every engine runs in its own
process, alternating over rounds; medians.

    python benchmarks/draft_model.py [--rounds 3] [--k 4] [--max-tokens 128] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import machine
import peers

PROMPTS = json.loads(Path(__file__).with_name("data").joinpath("speculative_prompts.json").read_text())
KINDS = ("open", "grounded")


def chats() -> dict[str, list[list[dict]]]:
    system = [{"role": "system", "content": PROMPTS["system"]}]
    return {"open": [[{"role": "user", "content": p}] for p in PROMPTS["open"]],
            "grounded": [system + [{"role": "user", "content": p}] for p in PROMPTS["grounded"]]}


def run_jaxllm(target: str, spec: dict | None, max_tokens: int) -> dict:
    from jaxllm import LLM, SamplingParams

    llm = LLM(model=target, dtype="float32", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    convs = chats()
    llm.chat(convs["open"][:1], params, use_tqdm=False)  # every code path once
    result = {}
    for kind in KINDS:
        tokens, seconds = 0, 0.0
        for conv in convs[kind]:
            start = time.perf_counter()
            out = llm.chat([conv], params, use_tqdm=False)[0].outputs[0]
            seconds += time.perf_counter() - start
            tokens += len(out.token_ids)
        result[f"{kind}_tok_s"], result[f"{kind}_tokens"] = tokens / seconds, tokens
    if (stats := llm.spec_decode_stats) is not None:
        result["acceptance_rate"] = stats.acceptance_rate
        result["mean_acceptance_length"] = stats.mean_acceptance_length
    return result


def run_llamacpp(bin_dir: Path, target: str, draft: str, k: int, max_tokens: int) -> dict:
    from jaxllm.loading.gguf_file import GGUFFile
    from jaxllm.tokenizer.gguf_tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(GGUFFile(draft).metadata, draft)  # the files' own chat template
    result = {}
    accepted = drafted = 0
    for kind, convs in chats().items():
        tokens, seconds = 0, 0.0
        for conv in convs:
            prompt = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
            out = subprocess.run([str(bin_dir / "llama-speculative"), "-m", target, "-md", draft, "-p", prompt,
                                  "-n", str(max_tokens), "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0",
                                  "--temp", "0", "-t", "2", "-c", "2048"],
                                 capture_output=True, text=True, check=True).stderr
            enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
            dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", out)
            tokens += int(dec.group(1))
            seconds += float(enc.group(2)) + float(dec.group(2))
            drafted += int(re.search(r"n_drafted\s*=\s*(\d+)", out).group(1))
            accepted += int(re.search(r"n_accept\s*=\s*(\d+)", out).group(1))
        result[f"{kind}_tok_s"], result[f"{kind}_tokens"] = tokens / seconds, tokens
    result["acceptance_rate"] = accepted / drafted if drafted else 0.0
    return result


def isolated(engine: str, args, target: str, draft: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--engine", engine, "--k", str(args.k), "--max-tokens",
                        str(args.max_tokens), "--target", target, "--draft", draft, "--json", str(out)], check=True)
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens (llama-speculative --spec-draft-n-max)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--engine", help=argparse.SUPPRESS)  # one run, here: plain, draft_model or llama.cpp
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--draft", help=argparse.SUPPRESS)
    args = p.parse_args()
    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}
    if args.engine:
        if args.engine == "llama.cpp":
            result = run_llamacpp(peers.peer_dir() / "bin", args.target, args.draft, args.k, args.max_tokens)
        else:
            result = run_jaxllm(args.target, spec if args.engine == "draft_model" else None, args.max_tokens)
        Path(args.json).write_text(json.dumps(result))
        return
    built = peers.peer_dir()
    target, draft = peers.gguf(built, "F32"), peers.gguf(built, "Q4_1")
    spec["model"] = draft
    names = ("plain", "draft_model", "llama.cpp")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names:
            runs[name].append(isolated(name, args, target, draft))
            print(f"round {r}: {name} {runs[name][-1]}", flush=True)
    metrics = [f"{kind}_tok_s" for kind in KINDS] + ["acceptance_rate"]
    summary = {name: {m: statistics.median(x.get(m, 0.0) for x in rs) for m in metrics} for name, rs in runs.items()}
    ratios = {f"draft_model/{other}": {m: summary["draft_model"][m] / summary[other][m] for m in metrics[:2]}
              for other in ("plain", "llama.cpp")}
    host = machine.describe()
    print(f"\nmedians over {args.rounds} rounds; target {Path(target).name}, draft {Path(draft).name}, k {args.k}, "
          f"up to {args.max_tokens} tokens\n{machine.line(host)}")
    print(f"{'':24s} {'open tok/s':>11s} {'grounded tok/s':>15s} {'drafts kept':>12s}")
    for name, m in summary.items():
        print(f"{name:24s} {m['open_tok_s']:11.1f} {m['grounded_tok_s']:15.1f} {m['acceptance_rate']:12.2f}")
    for name, m in ratios.items():
        print(f"{name:24s} {m['open_tok_s']:10.2f}x {m['grounded_tok_s']:14.2f}x")
    machine.save(args.json, host, rounds=args.rounds, k=args.k, max_tokens=args.max_tokens, target=Path(target).name,
                 draft=Path(draft).name, summary=summary, ratios=ratios, runs=runs)


if __name__ == "__main__":
    main()
