"""What the offline calls return, shaped as vLLM's: generation's `RequestOutput` / `CompletionOutput`; `LLM.encode`'s
`PoolingRequestOutput` (a vector as an array), `LLM.embed`'s `EmbeddingRequestOutput` (a list of floats),
`LLM.classify`'s `ClassificationRequestOutput` (class probabilities) and `LLM.score`'s `ScoringRequestOutput`."""

from __future__ import annotations

import dataclasses
import typing

import numpy as np


@dataclasses.dataclass
class Logprob:
    """vLLM's: a token's log probability, its rank in the distribution (1: the likeliest; a sampled token can rank
    anywhere) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


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
    # SamplingParams.prompt_logprobs: per prompt token, {token_id: Logprob} (the token and the top alternatives at
    # its position); the first is None (nothing precedes it). Complete once the prompt has been prefilled.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


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
class EmbeddingOutput:
    embedding: list[float]

    @property
    def data(self) -> np.ndarray:
        """The vector as `PoolingOutput.data` holds it (float32 array)."""
        return np.asarray(self.embedding, np.float32)

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]  # one per class: softmax over several, the sigmoid of a single logit

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class _TypedPoolingOutput:
    """A pooling request's output as one of vLLM's typed views (the vector as a list under the view's name)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput
    finished: bool = True
    num_cached_tokens: int = 0
    view: typing.ClassVar[type]

    @classmethod
    def from_pooling(cls, out: PoolingRequestOutput):
        return cls(out.request_id, out.prompt, out.prompt_token_ids, cls.view(out.outputs.data.tolist()),
                   out.finished, out.num_cached_tokens)


@dataclasses.dataclass
class EmbeddingRequestOutput(_TypedPoolingOutput):
    """vLLM's: what `LLM.embed` returns (`outputs.embedding`, a list of floats)."""

    outputs: EmbeddingOutput
    view = EmbeddingOutput


@dataclasses.dataclass
class ClassificationRequestOutput(_TypedPoolingOutput):
    """vLLM's: what `LLM.classify` returns (`outputs.probs`)."""

    outputs: ClassificationOutput
    view = ClassificationOutput


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
