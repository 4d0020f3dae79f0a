"""python -m jaxllm.generate: run a model locally through the engine.

With no --model it runs the embedded SmolLM2-135M-Instruct. Each prompt is a chat message (--raw for plain
text completion); with no prompt argument, each line of stdin is one prompt. A single prompt streams its
tokens as they are generated; several prompts run together in one continuous batch and print as they
finish. A last line (on stderr) gives the token counts and where the time went: loading (weights, KV cache),
compiling (only the step shapes this run needs, each built once; a later run loads them from the caches),
time to first token and the decode rate, the last two without compilation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from jaxllm.engine.config import EngineConfig, default_preset
from jaxllm.engine.llm_engine import LLMEngine
from jaxllm.errors import InvalidRequestError
from jaxllm.loading.errors import LoadError
from jaxllm.sampling_params import RequestOutputKind, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxllm.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: one per line of stdin)")
    m = p.add_argument_group("model and engine")
    m.add_argument("--model", help="HF folder, GGUF file, jaxllm orbax checkpoint, or a Hugging Face hub id org/name "
                                   "(org/name:Q4_K_M: that GGUF file of the repository); default: embedded SmolLM2")
    m.add_argument("--revision", help="of a hub id: a branch, tag or commit (default: main)")
    m.add_argument("--download-dir", help="Hugging Face cache for hub ids (default: huggingface_hub's, HF_HUB_CACHE)")
    m.add_argument("--preset", help="engine preset in jaxllm/configs/ or a TOML file (default: smollm2-cpu for the "
                   "embedded model, the platform's for others: cpu, gpu, tpu)")
    m.add_argument("--dtype", help="auto (float32 on CPU, bfloat16 on GPU/TPU), float32, bfloat16")
    m.add_argument("--tensor-parallel-size", type=int, help="devices to shard the model over")
    m.add_argument("--attn-impl", help="paged attention kernel: auto, reference, cpu, pallas_tpu, pallas_gpu")
    m.add_argument("--matmul-impl", help="matmul kernel: auto, reference (XLA's dot), cpu (steps of few tokens)")
    m.add_argument("--quantization", help="weights: auto (a GGUF file's own quantization, kept in memory), int8 "
                   "(per-channel, made at load from any checkpoint), none (dequantized to --dtype)")
    m.add_argument("--kv-cache-dtype", help="KV cache element type: auto (the model's), bfloat16, float16, "
                   "float32, float8_e4m3fn, float8_e5m2")
    m.add_argument("--max-model-len", type=int, help="maximum context length (prompt + generated)")
    m.add_argument("--max-num-seqs", type=int, help="maximum sequences in one batch")
    m.add_argument("--max-num-batched-tokens", type=int, help="token budget of one engine step")
    m.add_argument("--num-pages", type=int, help="KV-cache pages (default: sized from free memory)")
    m.add_argument("--page-size", type=int, help="tokens per KV-cache page")
    m.add_argument("--compilation-cache-dir", help="JAX persistent compilation cache ('' to disable)")
    m.add_argument("--warmup", action="store_true", help="compile every bucket before generating (as a server "
                   "does); by default shapes compile when first used")
    m.add_argument("-v", "--verbose", action="store_true", help="log engine start-up")
    c = p.add_argument_group("prompt")
    c.add_argument("--raw", action="store_true", help="complete plain text instead of a chat message")
    c.add_argument("--system", help="system message for chat prompts")
    s = p.add_argument_group("sampling (as in the OpenAI API and vLLM)")
    s.add_argument("--max-tokens", type=int, default=256, help="maximum new tokens per choice (default 256)")
    s.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    s.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, help="per-request seed (same seed, same output)")
    s.add_argument("-n", type=int, default=1, help="choices per prompt")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--stop-token-ids", type=int, nargs="*", default=[], help="token ids that end a choice")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    s.add_argument("--logprobs", type=int, help="print the top-N logprobs of each generated token")
    o = p.add_argument_group("structured outputs (one of; vLLM's structured_outputs)")
    o.add_argument("--json-schema", help="a JSON schema, or @file.json: the answer is JSON that validates")
    o.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    o.add_argument("--regex", help="the answer matches this regular expression")
    o.add_argument("--choice", action="append", help="the answer is one of these strings (repeatable)")
    o.add_argument("--grammar", help="a Lark or GBNF grammar, or @file: the answer is in its language")
    return p.parse_args(argv)


def _engine_config(args: argparse.Namespace, num_sequences: int) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in names and v is not None}
    config = EngineConfig.from_preset(args.preset or default_preset(args.model), **overrides)
    if config.num_pages is None and config.max_model_len is not None:
        # A one-shot run needs pages for its own sequences only, not a server's share of RAM (allocating and
        # freeing gigabytes was a visible part of a short run). A power of two: the count is a compiled shape,
        # so runs with similar numbers of prompts share their compiled steps.
        pages = min(num_sequences, config.max_num_seqs) * -(-config.max_model_len // config.page_size)
        config = dataclasses.replace(config, num_pages=1 << (pages - 1).bit_length())
    return config


def _text_or_file(value: str, param: str) -> str:
    try:
        return Path(value[1:]).read_text() if value.startswith("@") else value
    except OSError as e:
        raise InvalidRequestError(f"cannot read {value[1:]}: {e.strerror}", param) from None


def _constraint(args) -> dict | None:
    schema = None
    if args.json_schema:
        try:
            schema = json.loads(_text_or_file(args.json_schema, "json_schema"))
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"--json-schema is not JSON: {e}", "json_schema") from None
    grammar = args.grammar and _text_or_file(args.grammar, "grammar")
    given = {"json": schema, "regex": args.regex, "choice": args.choice, "grammar": grammar,
             "json_object": args.json_object or None}
    given = {k: v for k, v in given.items() if v is not None}
    return given or None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        print("error: no prompt given", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(
            n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
            min_tokens=args.min_tokens, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_ids),
            ignore_eos=args.ignore_eos, logprobs=args.logprobs, structured_outputs=_constraint(args))
    except InvalidRequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        engine = LLMEngine(_engine_config(args, len(prompts) * args.n), warmup=args.warmup)
    except LoadError as e:  # a model that cannot be found, fetched or read: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = engine.tokenizer
    if tok is None:
        print("error: this model has no tokenizer", file=sys.stderr)
        return 2
    system = [{"role": "system", "content": args.system}] if args.system else []
    start = time.perf_counter()
    try:
        prepared = [engine.prepare_prompt(prompt if args.raw else tok.apply_chat_template(
            system + [{"role": "user", "content": prompt}], tokenize=True), params) for prompt in prompts]
    except InvalidRequestError as e:  # the same checks as the Python API and the server
        print(f"error: {e}", file=sys.stderr)
        return 2
    runner, cfg = engine.runner, engine.config
    if not args.warmup:  # build the first step's shape and the decode step's together, not one after the other
        seqs = min(len(prepared) * args.n, cfg.max_num_seqs)
        first = min(sum(len(p.ids) for p in prepared) * args.n, cfg.max_num_batched_tokens)
        runner.prebuild([runner.bucket_for(first, seqs), runner.bucket_for(seqs, seqs)])
    stream = len(prompts) == 1 and args.n == 1
    if stream:  # each output carries what is new: printed as it comes
        params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)
    for i, prep in enumerate(prepared):
        engine.add_request(str(i), prep[1], params, prepared=prep)
    first_token_at, prompt_tokens, generated = None, 0, 0
    streamed_logprobs = []
    compile_before_first = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first_token_at is None:
                first_token_at = time.perf_counter()
                compile_before_first = runner.build_wait_s
            if stream:
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
                generated += len(out.outputs[0].token_ids)
                streamed_logprobs += out.outputs[0].logprobs or []
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                if not stream:
                    generated += sum(len(c.token_ids) for c in out.outputs)
                if not stream:
                    for c in out.outputs:
                        label = f"[{out.request_id}" + (f".{c.index}]" if args.n > 1 else "]")
                        print(f"{label} {prompts[int(out.request_id)]}\n{c.text}\n")
                if args.logprobs is not None:
                    for c in out.outputs:
                        for step in streamed_logprobs if stream else c.logprobs:
                            print("  " + "  ".join(f"{lp.decoded_token!r}:{lp.logprob:.3f}" for lp in step.values()))
    end = time.perf_counter()
    if stream:
        print(flush=True)
    # Compilation is reported on its own (the time generation waited for it: builds overlap), not counted in
    # the time to first token or the decode rate.
    compile_s = runner.build_wait_s
    ttft = first_token_at - start - compile_before_first if first_token_at else float("nan")
    decode_s = end - first_token_at - (compile_s - compile_before_first) if first_token_at else 0.0
    decoded = generated - len(prepared) * args.n  # the first token of each choice came with the prompt
    rate = f"{decoded / decode_s:.1f} tok/s" if decoded > 0 and decode_s > 0 else "n/a"
    up = engine.startup
    print(f"[{engine.model_name}] prompt tokens: {prompt_tokens}, generated tokens: {generated}; load "
          f"{up.load_s:.2f} s (KV cache {up.kv_cache_s:.2f} s), compile {compile_s + up.warmup_s:.2f} s "
          f"({len(runner.builds)} buckets), time to first token {ttft:.2f} s, decode {rate}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skips tearing down JAX's runtime and buffers at exit (slow with a large KV cache); nothing is left to write.
    os._exit(code)
