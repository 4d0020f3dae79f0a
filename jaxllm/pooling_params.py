"""Pooling: what a model that embeds does with a prompt's hidden states, and what one request asks of it.

`Pooling` is the model's side (how its checkpoint was trained to be read: last token, mean, or first token (CLS),
normalized or not; read from a sentence-transformers folder, or set with ``EngineConfig.pooling``).
`PoolingParams` is the request's (vLLM's ``PoolingParams``): normalization, Matryoshka ``dimensions``, and
``truncate_prompt_tokens``. A request with PoolingParams instead of SamplingParams is prefilled (in chunks, with the
token budget) and never decodes; its pooled vector is its output.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxllm.errors import InvalidRequestError
from jaxllm.sampling_params import MAX_INT, RequestLimits, check_int

POOLING_METHODS = ("last", "mean", "cls")
EMBED, GENERATE, CLASSIFY = "embed", "generate", "classify"
POOLING_TASKS = (EMBED, CLASSIFY)


@dataclasses.dataclass(frozen=True)
class Pooling:
    """How a model's hidden states become one vector: the last token's, their mean, or the first token's (CLS);
    normalized to unit length when `normalize`."""

    method: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(f"pooling method must be one of {POOLING_METHODS}, got {self.method!r}")

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states of tokens a prefix-cache hit would skip."""
        return self.method != "last"

    @classmethod
    def from_sentence_transformers(cls, folder: str | Path) -> Pooling | None:
        """The pooling of a sentence-transformers folder (``modules.json`` naming a Pooling module, its
        ``config.json``, and a Normalize module), or None if the folder has none."""
        folder = Path(folder)
        try:
            modules = json.loads((folder / "modules.json").read_text())
        except (OSError, ValueError):
            return None
        kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
        if "Pooling" not in kinds:
            return None
        config = json.loads((folder / kinds["Pooling"].get("path", "1_Pooling") / "config.json").read_text())
        if config.get("pooling_mode_lasttoken"):
            method = "last"
        elif config.get("pooling_mode_cls_token"):
            method = "cls"
        elif config.get("pooling_mode_mean_tokens"):
            method = "mean"
        else:
            modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode") and v)
            raise ValueError(f"{folder}: sentence-transformers pooling {modes} is not supported (last token, CLS or "
                             "mean)")
        return cls(method, normalize="Normalize" in kinds)


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """A pooling request's options. task: "embed" (the pooled vector) or "classify" (a cross-encoder's head on
    it: its label scores, a sigmoid for one label, else softmax). normalize: None for the model's own;
    dimensions: keep the first this many values (Matryoshka), normalized after truncation as vLLM and OpenAI do;
    truncate_prompt_tokens: keep only the last this many prompt tokens (otherwise a prompt longer than the context is
    refused)."""

    task: str = EMBED
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidRequestError(f"task must be one of {POOLING_TASKS}, got {self.task!r}", "task")
        if self.task == CLASSIFY and self.dimensions is not None:
            raise InvalidRequestError("dimensions applies to embeddings, not to classification", "dimensions")
        if self.normalize not in (None, True, False):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", "normalize")
        if self.dimensions is not None:
            object.__setattr__(self, "dimensions", check_int("dimensions", self.dimensions, 1, MAX_INT))
        if self.truncate_prompt_tokens is not None:
            object.__setattr__(self, "truncate_prompt_tokens",
                               check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, MAX_INT))

    # What the scheduler and runner ask of any request's params (SamplingParams answers the same).
    n = 1
    logprobs = None

    def verify(self, limits: RequestLimits, num_prompt_tokens: int) -> None:
        if self.task not in limits.tasks:
            raise InvalidRequestError(f"this model does not support the {self.task!r} task (it supports: "
                                      f"{', '.join(limits.tasks)})", "model")
        if self.dimensions is not None and self.dimensions > limits.hidden_size:
            raise InvalidRequestError(f"dimensions must be at most this model's {limits.hidden_size}, got "
                                      f"{self.dimensions}", "dimensions")


class PooledState:
    """One sequence's pooling across its prefill chunks (host side): each step hands in the chunk's first, last and
    summed hidden states; `result` gives the pooled vector once the last chunk is in."""

    def __init__(self, pooling: Pooling | None):
        self.pooling = pooling
        self.first: np.ndarray | None = None
        self.total: np.ndarray | None = None
        self.last: np.ndarray | None = None
        self.classified: np.ndarray | None = None

    def add_chunk(self, start: int, first: np.ndarray, last: np.ndarray, total: np.ndarray,
                  classified: np.ndarray) -> None:
        """start: the chunk's first position (0 starts over: a preempted sequence is recomputed); classified: the
        model's head on this chunk (a model without one: empty); the last chunk's is the sequence's (an encoder's
        input is one chunk; a decoder classifies from its last token)."""
        if start == 0 or self.total is None:
            self.first, self.total = first, total.astype(np.float64)
        else:
            self.total = self.total + total
        self.last, self.classified = last, classified

    def result(self, num_tokens: int, params: PoolingParams) -> np.ndarray:
        if params.task == CLASSIFY:
            logits = self.classified.astype(np.float64)
            if logits.shape[0] == 1:
                return (1 / (1 + np.exp(-logits))).astype(np.float32)
            e = np.exp(logits - logits.max())
            return (e / e.sum()).astype(np.float32)
        method = self.pooling.method
        v = self.last if method == "last" else self.first if method == "cls" else self.total / num_tokens
        v = np.asarray(v, np.float32)
        if params.dimensions is not None:
            v = v[:params.dimensions]
        normalize = self.pooling.normalize if params.normalize is None else params.normalize
        if normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)
