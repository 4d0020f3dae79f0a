"""Embeddings throughput: jaxllm's `LLM.embed` against sentence-transformers' `encode` on the same model, the same
256 inputs (16 to 512 tokens each, fixed seed), in the same run, alternating rounds; medians of inputs/s and
tokens/s. Models: a random BERT of all-MiniLM-L6-v2's shape (6 layers, 384 wide; mean pooling, the most used
embedding model's architecture), a random Qwen3 of Qwen3-Embedding-0.6B's layout scaled down (last-token pooling),
and the embedded SmolLM2-135M used as a last-token-pooling model (float32, converted from its GGUF by transformers).
jaxllm's start-up (compiling its buckets) is reported beside, not counted; its prefix cache is off (every round
embeds the same texts: a last-token model would otherwise reuse the first round's pages).

    python benchmarks/embed.py [--rounds 3] [--models minilm,qwen3,smollm2] [--json benchmarks/results/embed_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.tiny_models import (  # noqa: E402 (the tests' model builders)
    TOKENIZER_CORPUS,
    add_sentence_transformers_files,
    add_tiny_tokenizer,
    build_tiny_encoder,
)

NUM_INPUTS, MIN_TOKENS, MAX_TOKENS = 256, 16, 512
MINILM = dict(vocab_size=1000, hidden_size=384, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=12,
              max_position_embeddings=512)


def build(name: str, root: Path) -> tuple[Path, dict]:
    """The model's folder (a sentence-transformers model; SmolLM2: its GGUF file) and jaxllm's engine options."""
    folder = root / name
    if name == "minilm":
        build_tiny_encoder(folder, "bert", **MINILM)
        add_sentence_transformers_files(folder, "mean", max_seq_length=MAX_TOKENS, pad_token="[PAD]")
        return folder, dict(max_num_batched_tokens=512, max_num_seqs=64)
    if name == "qwen3":
        import torch
        import transformers

        config = transformers.Qwen3Config(vocab_size=1024, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                          max_position_embeddings=1024, tie_word_embeddings=True)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
        add_tiny_tokenizer(folder)
        add_sentence_transformers_files(folder, "last", max_seq_length=MAX_TOKENS)
        return folder, dict(max_num_batched_tokens=1024, max_num_seqs=64, enable_prefix_caching=False)
    if name == "smollm2":  # the GGUF as transformers dequantizes it, and as jaxllm does (quantization="none")
        from jaxllm.loading.embedded import embedded_model_path

        gguf = embedded_model_path()
        return gguf, dict(max_num_batched_tokens=1024, max_num_seqs=64, pooling="last", quantization="none",
                          enable_prefix_caching=False)
    raise ValueError(f"unknown model {name!r}")


def sentence_transformer(path: Path):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules

    if path.is_dir():
        return SentenceTransformer(str(path), device="cpu")
    gguf = {"gguf_file": path.name}  # (transformers reads the GGUF; it cannot save it as a folder)
    body = modules.Transformer(str(path.parent), max_seq_length=MAX_TOKENS, model_kwargs=gguf, processor_kwargs=gguf,
                               config_kwargs=gguf)
    body.tokenizer.pad_token = body.tokenizer.eos_token
    body.modality_config.pop("message", None)  # plain text in (it would wrap each text in the chat template)
    pooling = modules.Pooling(body.get_embedding_dimension(), pooling_mode="lasttoken")
    return SentenceTransformer(modules=[body, pooling, modules.Normalize()], device="cpu")


def inputs(tokenizer, rng: random.Random) -> list[str]:
    """NUM_INPUTS texts of MIN_TOKENS..MAX_TOKENS tokens each (special tokens included) under `tokenizer`."""
    words = " ".join(TOKENIZER_CORPUS * 4).split()
    texts = []
    for _ in range(NUM_INPUTS):
        target = rng.randint(MIN_TOKENS, MAX_TOKENS)
        ids: list[int] = []
        while len(ids) < target:
            ids += tokenizer.encode(" " + " ".join(rng.choice(words) for _ in range(16)), add_special_tokens=False)
        text = tokenizer.decode(ids[:target - 2], skip_special_tokens=True)
        texts.append(text)
    return texts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="minilm,qwen3,smollm2")
    p.add_argument("--json")
    args = p.parse_args()
    import torch

    from jaxllm import LLM

    results = {"inputs": NUM_INPUTS, "tokens_per_input": [MIN_TOKENS, MAX_TOKENS], "rounds": args.rounds,
               "torch_threads": torch.get_num_threads(), "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            folder, options = build(name, Path(tmp))
            st = sentence_transformer(folder)
            texts = inputs(st.tokenizer, random.Random(0))
            start = time.perf_counter()
            llm = LLM(str(folder), dtype="float32", compilation_cache_dir=None, **options)
            startup_s = time.perf_counter() - start
            tokens = sum(len(ids) for ids in (st.tokenizer(t)["input_ids"] for t in texts))
            ours_tokens = sum(len(o.prompt_token_ids) for o in llm.embed(texts[:8], use_tqdm=False))  # warm
            runs = {"jaxllm": [], "sentence-transformers": []}
            for r in range(args.rounds):
                start = time.perf_counter()
                ours = np.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
                runs["jaxllm"].append(time.perf_counter() - start)
                start = time.perf_counter()
                theirs = st.encode(texts, batch_size=32, convert_to_numpy=True)
                runs["sentence-transformers"].append(time.perf_counter() - start)
                print(f"{name} round {r}: " + "  ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()), flush=True)
            diff = float(np.abs(ours - theirs).max())
            med = {k: statistics.median(v) for k, v in runs.items()}
            row = {"jaxllm_inputs_per_s": NUM_INPUTS / med["jaxllm"], "jaxllm_tokens_per_s": tokens / med["jaxllm"],
                   "st_inputs_per_s": NUM_INPUTS / med["sentence-transformers"],
                   "st_tokens_per_s": tokens / med["sentence-transformers"],
                   "ratio": med["sentence-transformers"] / med["jaxllm"],
                   "rounds_s": runs, "tokens": tokens, "max_abs_diff": diff, "jaxllm_startup_s": startup_s,
                   "engine_options": options}
            results["models"][name] = row
            print(f"{name}: jaxllm {row['jaxllm_inputs_per_s']:.1f} inputs/s ({row['jaxllm_tokens_per_s']:.0f} tok/s), "
                  f"sentence-transformers {row['st_inputs_per_s']:.1f} inputs/s ({row['st_tokens_per_s']:.0f} tok/s): "
                  f"{row['ratio']:.2f}x; max |diff| {diff:.1e}; jaxllm start-up {startup_s:.1f} s "
                  f"({ours_tokens} warm-up tokens)", flush=True)
            del llm, st
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
