"""Encoders of the BERT family (``BertModel``, ``XLMRobertaModel``, and their ``*ForSequenceClassification``
cross-encoders): bidirectional attention within each sequence, learned absolute positions, post-LayerNorm blocks.

The engine calls it like the decoder (``forward_paged(ids [T], positions [T], kv_cache, metadata)`` on a flat
batch of whole sequences), so pooling requests for it batch and schedule the same way; it reads no cache (the
cache passes through untouched) and its sequences are never split into chunks (every token attends to every
other). ``classify`` is the cross-encoder's head on the first ([CLS]) token.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxllm.config import ConfigError

ENCODER_ARCHITECTURES = {  # HF architecture -> (family, has a classification head)
    "BertModel": ("bert", False), "BertForSequenceClassification": ("bert", True),
    "XLMRobertaModel": ("roberta", False), "XLMRobertaForSequenceClassification": ("roberta", True),
    "RobertaModel": ("roberta", False), "RobertaForSequenceClassification": ("roberta", True),
}
ENCODER_MODEL_TYPES = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel", "roberta": "RobertaModel"}


@dataclasses.dataclass(frozen=True)
class EncoderConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    position_offset: int = 0  # RoBERTa counts positions from padding_idx + 1
    sep_token_id: int | None = None  # token types of a pair: 1 from the first separator on (BERT)
    num_labels: int = 0  # a cross-encoder's outputs; 0: no head
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                              f"{self.num_heads}")

    @property
    def family(self) -> str:
        return ENCODER_ARCHITECTURES[self.architecture][0]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def num_kv_heads(self) -> int:  # (the engine's cache shape; an encoder reads no cache)
        return self.num_heads

    @property
    def max_input_tokens(self) -> int:
        return self.max_position_embeddings - self.position_offset

    @classmethod
    def from_hf(cls, hf: dict[str, Any], sep_token_id: int | None = None) -> EncoderConfig:
        arch = (hf.get("architectures") or [ENCODER_MODEL_TYPES.get(hf.get("model_type"), "")])[0]
        if arch not in ENCODER_ARCHITECTURES:
            raise ConfigError(f"unsupported encoder architecture {arch!r}; supported: "
                              f"{', '.join(sorted(ENCODER_ARCHITECTURES))}")
        if hf.get("hidden_act", "gelu") != "gelu" or hf.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError("only absolute positions and the gelu activation are supported for encoders")
        family, head = ENCODER_ARCHITECTURES[arch]
        try:
            return cls(
                architecture=arch, vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
                intermediate_size=int(hf["intermediate_size"]), num_layers=int(hf["num_hidden_layers"]),
                num_heads=int(hf["num_attention_heads"]), max_position_embeddings=int(hf["max_position_embeddings"]),
                type_vocab_size=int(hf.get("type_vocab_size", 2)),
                layer_norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
                position_offset=int(hf.get("pad_token_id", 1)) + 1 if family == "roberta" else 0,
                sep_token_id=sep_token_id if int(hf.get("type_vocab_size", 2)) > 1 else None,
                num_labels=len(hf.get("id2label") or {0: 0, 1: 1}) if head else 0)
        except KeyError as e:
            raise ConfigError(f"missing the field {e.args[0]!r}") from None


def _param(shape, dtype, rngs: nnx.Rngs | None, scale: float = 0.02, ones: bool = False):
    if rngs is None:
        return nnx.Param(jax.ShapeDtypeStruct(shape, dtype))
    if ones:
        return nnx.Param(jnp.ones(shape, dtype))
    if len(shape) == 1:
        return nnx.Param(jnp.zeros(shape, dtype))
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) * scale)


class Dense(nnx.Module):
    """y = x @ W.T + b, W [out, in] as checkpoints store it."""

    def __init__(self, din: int, dout: int, *, dtype, rngs):
        self.weight = _param((dout, din), dtype, rngs)
        self.bias = _param((dout,), dtype, rngs)

    def __call__(self, x):
        return x @ self.weight[...].T + self.bias[...]


class LayerNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, rngs):
        self.weight = _param((dim,), dtype, rngs, ones=True)
        self.bias = _param((dim,), dtype, rngs)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        return ((xf - mean) * jax.lax.rsqrt(var + self.eps)).astype(x.dtype) * self.weight[...] + self.bias[...]


class EncoderLayer(nnx.Module):
    def __init__(self, cfg: EncoderConfig, *, dtype, rngs):
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.heads = cfg.num_heads
        self.query, self.key, self.value = (Dense(e, e, dtype=dtype, rngs=rngs) for _ in range(3))
        self.attention_out = Dense(e, e, dtype=dtype, rngs=rngs)
        self.attention_norm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.intermediate = Dense(e, f, dtype=dtype, rngs=rngs)
        self.output = Dense(f, e, dtype=dtype, rngs=rngs)
        self.output_norm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)

    def __call__(self, x, same_sequence):
        """x [T, E]; same_sequence [T, T] bool: which tokens each token attends to."""
        t, e = x.shape
        d = e // self.heads
        q, k, v = (proj(x).reshape(t, self.heads, d) for proj in (self.query, self.key, self.value))
        scores = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32)) * d ** -0.5
        scores = jnp.where(same_sequence[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)  # every token attends at least to itself: no empty rows
        attn = jnp.einsum("hqk,khd->qhd", probs, v.astype(jnp.float32)).reshape(t, e).astype(x.dtype)
        x = self.attention_norm(x + self.attention_out(attn))
        return self.output_norm(x + self.output(jax.nn.gelu(self.intermediate(x), approximate=False)))


class EncoderModel(nnx.Module):
    # What the engine asks of any model: an encoder is not causal (whole sequences a step, no chunks), keeps no
    # quantized weights, and its kernel choice is XLA's.
    causal = False
    multimodal = False
    quantization = ()
    quant_plan: dict = {}  # noqa: RUF012 (read only)

    def __init__(self, cfg: EncoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        e = cfg.hidden_size
        self.config, self.dtype = cfg, dtype
        self.word_embeddings = _param((cfg.vocab_size, e), dtype, rngs)
        self.position_embeddings = _param((cfg.max_position_embeddings, e), dtype, rngs)
        self.token_type_embeddings = _param((cfg.type_vocab_size, e), dtype, rngs)
        self.embedding_norm = LayerNorm(e, cfg.layer_norm_eps, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([EncoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        if cfg.num_labels:  # BERT: pooler (dense + tanh) then classifier; RoBERTa: classifier.dense + out_proj
            self.head_dense = Dense(e, e, dtype=dtype, rngs=rngs)
            self.head_out = Dense(e, cfg.num_labels, dtype=dtype, rngs=rngs)
        from jaxllm.kernels import choose_kernels
        self.kernels = choose_kernels("reference", "reference", dtype=dtype)

    def _token_types(self, ids, seq_of_token, qsl):
        cfg = self.config
        if cfg.sep_token_id is None:
            return jnp.zeros_like(ids)
        sep = (ids == cfg.sep_token_id).astype(jnp.int32)
        before = jnp.cumsum(sep) - sep  # separators strictly before each token, counted from the batch start
        start = qsl[jnp.clip(seq_of_token, 0, qsl.shape[0] - 2)]
        at_start = before[jnp.clip(start, 0, ids.shape[0] - 1)]
        return jnp.minimum(before - at_start, cfg.type_vocab_size - 1)

    def forward_paged(self, input_ids, positions, kv_cache, metadata):
        """input_ids, positions [T] (whole sequences, as `metadata.query_start_loc` delimits them) -> hidden [T, E],
        and the cache unchanged."""
        t = input_ids.shape[0]
        qsl = metadata.query_start_loc
        seq_of_token = metadata.sequence_of_token(t)  # padding: past the last sequence
        same_sequence = seq_of_token[:, None] == seq_of_token[None, :]  # [T, T]
        types = self._token_types(input_ids, seq_of_token, qsl)
        x = self.word_embeddings[...][input_ids] + self.token_type_embeddings[...][types] + \
            self.position_embeddings[...][positions + self.config.position_offset]
        x = self.embedding_norm(x)
        for layer in self.layers:
            x = layer(x, same_sequence)
        return x, kv_cache

    @property
    def classifies(self) -> bool:
        return self.config.num_labels > 0

    def set_classifier_tokens(self, token_ids: tuple[int, ...]) -> None:
        raise ValueError("classifier tokens are a decoder's: an encoder classifies with its own head")

    def arrange_layers(self) -> None:  # one layout: the layers run unrolled
        pass

    def classify(self, pooled: jax.Array) -> jax.Array:
        """The cross-encoder's head on the first ([CLS]) token: pooled [S, 3, E] (first, last, summed hidden
        state) -> [S, num_labels] float32."""
        if not self.config.num_labels:
            return jnp.zeros((pooled.shape[0], 0), jnp.float32)
        return self.head_out(jnp.tanh(self.head_dense(pooled[:, 0]))).astype(jnp.float32)

    def logits(self, hidden):  # an encoder does not generate: the engine never samples from it
        return jnp.zeros((*hidden.shape[:-1], 1), jnp.float32)


def encoder_parameter_names(cfg: EncoderConfig) -> dict[str, tuple]:
    """Checkpoint tensor name (without the "bert." / "roberta." prefix) -> path in `EncoderModel`."""
    names = {"embeddings.word_embeddings.weight": ("word_embeddings",),
             "embeddings.position_embeddings.weight": ("position_embeddings",),
             "embeddings.token_type_embeddings.weight": ("token_type_embeddings",),
             "embeddings.LayerNorm.weight": ("embedding_norm", "weight"),
             "embeddings.LayerNorm.bias": ("embedding_norm", "bias")}
    parts = {"attention.self.query": "query", "attention.self.key": "key", "attention.self.value": "value",
             "attention.output.dense": "attention_out", "attention.output.LayerNorm": "attention_norm",
             "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}
    for i in range(cfg.num_layers):
        for hf, ours in parts.items():
            for kind in ("weight", "bias"):
                names[f"encoder.layer.{i}.{hf}.{kind}"] = ("layers", i, ours, kind)
    if cfg.num_labels:
        head = {"bert": {"pooler.dense": "head_dense", "classifier": "head_out"},
                "roberta": {"classifier.dense": "head_dense", "classifier.out_proj": "head_out"}}[cfg.family]
        for hf, ours in head.items():
            for kind in ("weight", "bias"):
                names[f"{hf}.{kind}"] = (ours, kind)
    return names


def strip_prefix(name: str) -> str:
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix) and not name.startswith(("classifier.", "pooler.")):
            return name[len(prefix):]
    return name


def load_encoder_arrays(model: EncoderModel, tensors: dict[str, np.ndarray]) -> None:
    """Fills `model` (built with rngs=None) from checkpoint tensors; raises ConfigError naming what is missing."""
    cfg = model.config
    wanted = encoder_parameter_names(cfg)
    got = {strip_prefix(k): v for k, v in tensors.items()}
    missing = [k for k in wanted if k not in got]
    if missing:
        raise ConfigError(f"the checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")
    for name, path in wanted.items():
        target = model
        for step in path[:-1]:
            target = target[step] if isinstance(step, int) else getattr(target, step)
        var = getattr(target, path[-1])
        value = np.asarray(got[name])
        if value.shape != var.get_value().shape:
            raise ConfigError(f"{name}: shape {value.shape}, expected {var.get_value().shape}")
        var.set_value(jnp.asarray(value, model.dtype))
