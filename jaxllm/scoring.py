"""Scoring text pairs, for `LLM.score` / `LLM.rerank` and the /score and /rerank routes (vLLM's semantics).

A cross-encoder (a model with the "classify" task) reads each pair as one input, ``[CLS] a [SEP] b [SEP]``, and its
head's sigmoid is the score; a decoder reranker (``classifier_tokens=("no", "yes")``) reads the pair through its
``score_template`` and the score is the softmax of those tokens' logits, the last one's. An embedding model embeds
both sides (each distinct text once) and the score is the cosine similarity. Pairs are 1:N (one first text against
several) or N:N (element-wise).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from jaxllm.errors import InvalidRequestError
from jaxllm.outputs import PoolingRequestOutput
from jaxllm.pooling_params import CLASSIFY, EMBED, PoolingParams
from jaxllm.sampling_params import check_text
from jaxllm.tokenizer.tokenizer import Tokenizer

MAX_PAIRS = 2048


def pairs(text_1: str | Sequence[str], text_2: str | Sequence[str], names=("text_1", "text_2")) -> list[
        tuple[str, str]]:
    """1:N when `text_1` is one text, N:N (element-wise) when both are lists of one length."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (first, second), strict=True):
        if not texts:
            raise InvalidRequestError(f"{name} must not be empty", name)
        for t in texts:
            check_text(name, t)
            if not t.strip():
                raise InvalidRequestError(f"{name} must hold text other than whitespace", name)
    if len(first) == 1:
        first = first * len(second)
    elif len(first) != len(second):
        raise InvalidRequestError(f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one "
                                  f"{names[0]}, or as many as {names[1]}", names[1])
    if len(first) > MAX_PAIRS:
        raise InvalidRequestError(f"at most {MAX_PAIRS} pairs per request, got {len(first)}", names[1])
    return list(zip(first, second, strict=True))


@dataclasses.dataclass
class ScorePlan:
    """The pooling requests that score some pairs, and how their outputs become one score per pair."""

    prompts: list[str | list[int]]
    params: PoolingParams
    combine: Callable[[list[PoolingRequestOutput]], list[float]]


def plan(tasks: Sequence[str], tokenizer: Tokenizer | None, text_pairs: list[tuple[str, str]],
         truncate_prompt_tokens: int | None = None, template: str | None = None) -> ScorePlan:
    """How a model with `tasks` scores `text_pairs`: a classifier reads each pair as one input (the tokenizer's
    pair encoding, or `template` with "{query}" and "{document}" filled in) and its last label's probability is
    the score; an embedding model's is the cosine. Raises InvalidRequestError if it can do neither."""
    if CLASSIFY in tasks:
        if tokenizer is None:
            raise InvalidRequestError("scoring text needs the model's tokenizer; this engine has none", "model")
        if template is not None:
            prompts = [tokenizer.encode(template.replace("{query}", a).replace("{document}", b))
                       for a, b in text_pairs]
        else:
            prompts = [tokenizer.encode_pair(a, b) for a, b in text_pairs]
        params = PoolingParams(task=CLASSIFY, truncate_prompt_tokens=truncate_prompt_tokens)
        return ScorePlan(prompts, params, lambda outs: [float(o.outputs.data[-1]) for o in outs])
    if EMBED in tasks:
        texts = list(dict.fromkeys(t for pair in text_pairs for t in pair))
        index = {t: i for i, t in enumerate(texts)}

        def cosine(outs: list[PoolingRequestOutput]) -> list[float]:
            vectors = [o.outputs.data.astype(np.float64) for o in outs]
            return [float(np.dot(vectors[index[a]], vectors[index[b]]) / max(
                np.linalg.norm(vectors[index[a]]) * np.linalg.norm(vectors[index[b]]), 1e-12)) for a, b in text_pairs]
        return ScorePlan(texts, PoolingParams(task=EMBED, truncate_prompt_tokens=truncate_prompt_tokens), cosine)
    raise InvalidRequestError(f"this model cannot score text pairs (it supports: {', '.join(tasks)}); serve a "
                              "cross-encoder or an embedding model", "model")


def ranked(scores: list[float], top_n: int | None) -> list[tuple[int, float]]:
    """(document index, score), best first (ties: the earlier document), the first `top_n` of them."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return [(i, scores[i]) for i in order[:top_n]]
