"""What the engine relies on in a model, as typed protocols: the engine reads these members and nothing else
(no probing with ``getattr``/``hasattr``), and a new family conforms by defining them.

Every model generates, pools or classifies through the same paged step: ``forward_paged`` turns a step's tokens
into final hidden states through the KV cache the engine owns; ``logits`` and ``classify`` read those rows.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from jaxllm.attention_metadata import AttentionMetadata
from jaxllm.kernels import Kernels


class ModelShape(Protocol):
    """The config fields the engine sizes the KV cache, the limits and the sampler with."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class Model(Protocol):
    config: Any  # a `ModelShape`: `ModelConfig` for decoders, `EncoderConfig` for encoders
    dtype: Any
    kernels: Kernels
    # Causal: prompts may be prefilled in chunks over a KV cache and the model can generate; an encoder reads
    # whole sequences in one step and only pools or classifies.
    causal: bool
    # Takes images (`MultimodalModel`): its steps carry M-RoPE positions and image embeddings.
    multimodal: bool

    @property
    def classifies(self) -> bool:
        """Whether `classify` returns label scores (a cross-encoder's head, or a reranker's label tokens)."""

    def forward_paged(self, input_ids: jax.Array, positions: jax.Array, kv_cache: tuple[jax.Array, jax.Array],
                      metadata: AttentionMetadata) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """input_ids [T], positions [T] ([3, T] with M-RoPE) -> final hidden states [T, E] and the cache."""

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., E] -> float32 logits [..., V]."""

    def classify(self, pooled: jax.Array) -> jax.Array:
        """pooled [S, 3, E] (each sequence's first, last and summed hidden state) -> float32 [S, labels]."""

    def set_classifier_tokens(self, token_ids: tuple[int, ...]) -> None:
        """Makes a decoder a classifier over the last token's logits of `token_ids` (a reranker's labels)."""

    def arrange_layers(self) -> None:
        """Lays the layers out as the kernel choice's layer loop runs them."""


@runtime_checkable
class MultimodalModel(Model, Protocol):
    """A vision-language model: its encoder (`visual`) turns images into embeddings the step puts in place of the
    image tokens; `vl_config` names those tokens."""
    visual: Any
    vl_config: Any
