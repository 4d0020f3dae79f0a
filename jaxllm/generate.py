"""`python -m jaxllm.generate`: run a model locally from the command line.

With no --model, runs the embedded SmolLM2-135M-Instruct. Prompts are chat messages by default (--raw for
plain text completion); with no prompt argument, each line of stdin is one prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

from jaxllm.loading import load_model
from jaxllm.paged_runner import PagedRunner


def greedy_generate(runner: PagedRunner, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_ids: tuple[int, ...] = (),
                    on_token: Callable[[int, int], None] | None = None) -> list[list[int]]:
    """Greedy decoding of a batch of prompts through the paged cache: one prefill step, then one decode
    step per token. Returns the generated ids of each prompt (the EOS token included when it stops)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    chunks = dict(enumerate(prompts))
    for _ in range(max_new_tokens):
        if not chunks:
            break
        logits = runner.step(chunks)
        chunks = {}
        for i, row in logits.items():
            token = int(np.argmax(row[-1]))
            outputs[i].append(token)
            if on_token:
                on_token(i, token)
            if token not in eos_token_ids:
                chunks[i] = [token]
    for i in range(len(prompts)):
        runner.release(i)
    return outputs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxllm.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: one per line of stdin)")
    p.add_argument("--model", default=None,
                   help="HF folder, GGUF file or jaxllm orbax checkpoint (default: embedded SmolLM2)")
    p.add_argument("--raw", action="store_true", help="complete plain text instead of a chat message")
    p.add_argument("--system", default=None, help="system message for chat prompts")
    p.add_argument("--max-tokens", type=int, default=128, help="maximum new tokens per prompt (default 128)")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on GPU/TPU), float32, bfloat16")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="devices to shard the model over")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV-cache page (default 16)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt given", file=sys.stderr)
        return 2
    lm = load_model(args.model, dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size)
    tok = lm.tokenizer
    if tok is None:
        print(f"error: {args.model} has no tokenizer", file=sys.stderr)
        return 2
    if args.raw:
        ids = [tok.encode(p) for p in prompts]
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        ids = [tok.apply_chat_template(system + [{"role": "user", "content": p}], tokenize=True) for p in prompts]
    pages_per_seq = -(-(max(map(len, ids)) + args.max_tokens) // args.page_size)
    runner = PagedRunner(lm.model, num_pages=pages_per_seq * len(ids), page_size=args.page_size, mesh=lm.mesh)
    stream = len(prompts) == 1
    streamed: list[int] = []
    printed = ""
    first_token_at: list[float] = []
    start = time.perf_counter()

    def on_token(i: int, token: int) -> None:
        nonlocal printed
        if not first_token_at:
            first_token_at.append(time.perf_counter())
        if stream and token not in tok.eos_token_ids:
            # Decode the whole output and print what is new, holding back an incomplete UTF-8 character.
            streamed.append(token)
            text = tok.decode(streamed)
            if not text.endswith("\ufffd"):
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text

    outputs = greedy_generate(runner, ids, args.max_tokens, tok.eos_token_ids, on_token)
    elapsed = time.perf_counter() - start
    if stream:
        print(flush=True)
    else:
        for prompt, out in zip(prompts, outputs, strict=True):
            print(f"### {prompt}\n{tok.decode(out)}\n")
    generated = sum(map(len, outputs))
    ttft = first_token_at[0] - start if first_token_at else float("nan")
    print(f"[{lm.name}] prompt tokens: {sum(map(len, ids))}, generated tokens: {generated}, "
          f"{generated / elapsed:.1f} tok/s, time to first token: {ttft:.2f} s (includes compilation)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
