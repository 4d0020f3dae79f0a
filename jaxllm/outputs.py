"""What generation returns, shaped like vLLM's `RequestOutput` / `CompletionOutput`, and what pooling returns
(`PoolingRequestOutput`)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Logprob:
    logprob: float
    decoded_token: str


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token: {token_id: Logprob} with the sampled token and the top alternatives.
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (see RequestOutput.error)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Prompt tokens served from the prefix cache (not recomputed).
    num_cached_tokens: int = 0
    # Set when handling this request failed (the other requests went on); the request is then finished.
    error: str | None = None


@dataclasses.dataclass
class PoolingOutput:
    data: np.ndarray  # [dimensions] float32: the pooled (and, if asked, normalized) vector


@dataclasses.dataclass
class PoolingRequestOutput:
    """What a pooling request returns (vLLM's `PoolingRequestOutput`; `EmbeddingRequestOutput` has the same
    fields): its vector once its whole prompt has been through the model."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput | None
    finished: bool
    error: str | None = None
    num_cached_tokens: int = 0


@dataclasses.dataclass
class ScoringOutput:
    score: float


@dataclasses.dataclass
class ScoringRequestOutput:
    """One pair's score (vLLM's `ScoringRequestOutput`): a cross-encoder's, or the cosine of two embeddings."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the pair's input (a cross-encoder), or both texts' (an embedding model)
    finished: bool = True


@dataclasses.dataclass
class RerankResult:
    index: int  # the document's position in the request
    document: str
    relevance_score: float
