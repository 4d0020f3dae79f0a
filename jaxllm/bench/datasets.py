"""The requests a serving benchmark sends: ``random`` (prompts of random tokens, vLLM's default dataset) or
``custom`` (a JSONL file of {"prompt": ...} lines). Prompt lengths are counted with the served model's tokenizer,
so that a run's input tokens mean the same on every server."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxllm.tokenizer.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens, by the tokenizer given
    expected_output_len: int

    def __post_init__(self):
        if self.expected_output_len < 1:
            raise ValueError(f"expected_output_len must be at least 1, got {self.expected_output_len}")


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """n lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)] (vLLM's --random-range-ratio)."""
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _ordinary_ids(tokenizer: Tokenizer) -> np.ndarray:
    """Token ids that are not special (no BOS/EOS/chat markers inside a random prompt)."""
    special = set(tokenizer.backend.get_added_tokens_decoder())
    return np.array([i for i in range(tokenizer.vocab_size) if i not in special], np.int64)


def _text_of_length(tokenizer: Tokenizer, ids: np.ndarray, target: int, pool: np.ndarray,
                    rng: np.random.Generator) -> tuple[str, int]:
    """A text that re-encodes to `target` tokens, or as near as a few adjustments get: decoding random ids and
    encoding the text again merges some and splits others."""
    ids = list(ids)
    for _ in range(8):
        text = tokenizer.decode(ids)
        n = len(tokenizer.encode(text, add_special_tokens=False))
        if n == target:
            break
        ids = ids[:target - n] if n > target else ids + list(rng.choice(pool, size=target - n))
    text = tokenizer.decode(ids)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(tokenizer: Tokenizer, num_prompts: int, *, input_len: int, output_len: int,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` prompts of random ordinary tokens (a shared random prefix of `prefix_len` first), lengths
    uniform within `range_ratio` of `input_len` / `output_len`. Every prompt differs from its first token after the
    prefix, so a prefix cache can hit only on the prefix; another `seed` gives prompts no server has seen."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 1 or output_len < 1 or prefix_len < 0 or num_prompts < 1:
        raise ValueError("input and output lengths and the number of prompts must be positive")
    rng = np.random.default_rng(seed)
    pool = _ordinary_ids(tokenizer)
    prefix = rng.choice(pool, size=prefix_len)
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(inputs, outputs, strict=True):
        ids = np.concatenate([prefix, rng.choice(pool, size=int(n_in))])
        text, n = _text_of_length(tokenizer, ids, prefix_len + int(n_in), pool, rng)
        requests.append(SampleRequest(text, n, int(n_out)))
    return requests


def custom_requests(path: str | Path, tokenizer: Tokenizer, num_prompts: int, *,
                    output_len: int) -> list[SampleRequest]:
    """The first `num_prompts` prompts of a JSONL file whose lines are {"prompt": "..."} (vLLM's custom
    dataset), each asked for `output_len` tokens."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = json.loads(line)["prompt"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a JSON object with a \"prompt\" ({e})") from None
            if not isinstance(prompt, str):
                raise ValueError(f"{path}:{number}: \"prompt\" is not a string")
            requests.append(SampleRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)),
                                          output_len))
            if len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests
