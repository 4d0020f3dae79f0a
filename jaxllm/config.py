"""Model configuration: one frozen dataclass for the whole Llama family.

It is built from a Hugging Face ``config.json`` dict or from GGUF metadata, and validates itself so a bad
checkpoint fails at load time with a message, not deep inside a jitted forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


class ConfigError(ValueError):
    """A model configuration that jaxllm cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # Per-frequency divisors stored by llama.cpp (`rope_freqs.weight`) in place of llama3 metadata.
    freq_factors: tuple[float, ...] | None = None
    # Multimodal rotary positions (Qwen-VL): the frequency slots (head_dim / 2 in all) that rotate by the temporal,
    # height and width position; positions are then [3, ...]. Interleaved (Qwen3-VL): slot j rotates by height if
    # j % 3 == 1 and j < 3 * sections[1], by width if j % 3 == 2 and j < 3 * sections[2], else by time (Qwen2.5-VL:
    # the sections are consecutive runs).
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    # The share of each head's dimensions that rotates (Phi-3.5, Phi-4-mini: 0.75); the rest passes through.
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3/3.5 128k, Phi-4-mini): per-frequency divisors for contexts up to
    # original_max_position_embeddings (short) and beyond (long), and which set the model runs: the long one when
    # its context can exceed the original (`LlamaForCausalLM.set_context_length`, as llama.cpp picks by its context
    # size; transformers picks by each forward's length, which a KV cache cannot follow)
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    long_context: bool = False

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"unsupported rope_scaling type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.theta <= 0 or self.factor <= 0:
            raise ConfigError(f"rope theta and factor must be positive, got {self.theta} and {self.factor}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(int(v) for v in self.mrope_section))
            if len(self.mrope_section) != 3:
                raise ConfigError(f"mrope_section must have 3 entries (t, h, w), got {self.mrope_section}")
        for name in ("short_factor", "long_factor", "freq_factors"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(float(v) for v in getattr(self, name)))
        if self.rope_type == "longrope" and (self.short_factor is None or self.long_factor is None
                                             or len(self.short_factor) != len(self.long_factor)):
            raise ConfigError("longrope needs short_factor and long_factor of one length (rotary_dim / 2)")
        if self.rope_type in ("llama3", "yarn", "longrope") and self.original_max_position_embeddings is None:
            raise ConfigError(f"rope type {self.rope_type!r} needs original_max_position_embeddings")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Reads both the legacy (`rope_theta` + `rope_scaling`) and the transformers v5 (`rope_parameters`)
        spellings."""
        params = dict(hf.get("rope_parameters") or {})
        legacy = dict(hf.get("rope_scaling") or {})
        params = {**legacy, **params}
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
        if rope_type == "mrope":  # Qwen2-VL's flat configs name it a type; the frequencies are the default ones
            rope_type = "default"
        if rope_type in ("longrope", "su"):  # "su": Phi-3's first name for it; the original length top-level
            rope_type = "longrope"
            params.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
            if params.get("factor") is None and params["original_max_position_embeddings"]:
                params["factor"] = hf.get("max_position_embeddings", 0) / params["original_max_position_embeddings"]
        if "partial_rotary_factor" not in params and hf.get("partial_rotary_factor") is not None:
            params["partial_rotary_factor"] = hf["partial_rotary_factor"]
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in params.items() if k in names and v is not None}
        return cls(theta=float(theta), rope_type=rope_type, **kwargs)


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2, some Llamas)
    o_bias: bool = False  # o_proj bias (Llama's attention_bias covers it, Qwen2's does not)
    qk_norm: bool = False  # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None  # every layer's
    # Per layer: its attention window (0: the whole context), when layers differ (Gemma 2 and 3, Qwen2's
    # `layer_types`): a runtime value under the layer scan. None: every layer has `sliding_window`.
    layer_windows: tuple[int, ...] | None = None
    activation: str = "silu"  # the gated MLP's: silu (SwiGLU), gelu_tanh or gelu (GeGLU)
    # Gemma's departures from the Llama decoder (Gemma 2 and 3):
    # RMSNorm: None, Llama's (the normalised x cast to the dtype, times w); a float c, Gemma's (x times (c + w) in
    # float32, then cast): 1.0 for Hugging Face checkpoints, 0.0 for GGUF files (llama.cpp stores 1 + w).
    rms_norm_offset: float | None = None
    sandwich_norms: bool = False  # norms on the attention's and the MLP's outputs too (pre/post_feedforward_...)
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), rounded to the model's dtype first
    attn_scale: float | None = None  # attention's score scale (None: head_dim ** -0.5)
    attn_soft_cap: float | None = None  # attention scores s -> cap * tanh(s / cap)
    final_soft_cap: float | None = None  # final logits, likewise
    local_rope: RopeConfig | None = None  # the windowed layers' RoPE where it differs from the others' (Gemma 3)
    # Mixture of experts (every layer's MLP; 0 experts: a dense MLP): each token's MLP is the weighted sum of its
    # `num_experts_per_tok` best experts by the router's softmax (renormalised over them with `norm_topk_prob`),
    # each a gated MLP of `moe_intermediate_size`; plus, with `shared_expert_intermediate_size`, one expert every
    # token runs, scaled by a sigmoid gate (Qwen2-MoE).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    # GPT-OSS's departures: attention sinks (a learned logit per q head that joins every softmax, `sinks` [heads]);
    # biases on the router and the experts; experts whose SwiGLU clamps (gate <= limit, |up| <= limit) and runs
    # gate * sigmoid(alpha * gate) * (up + 1).
    attention_sinks: bool = False
    moe_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.layer_windows is not None and (len(self.layer_windows) != self.num_layers or
                                               any(w < 0 for w in self.layer_windows)):
            raise ConfigError(f"layer_windows needs one window >= 0 per layer ({self.num_layers}), got "
                              f"{self.layer_windows}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        for name in ("attn_scale", "attn_soft_cap", "final_soft_cap", "swiglu_limit"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise ConfigError(f"a mixture of {self.num_experts} experts needs 0 < num_experts_per_tok <= "
                              f"num_experts (got {self.num_experts_per_tok}) and a positive moe_intermediate_size "
                              f"(got {self.moe_intermediate_size})")
        if (self.moe_bias or self.swiglu_limit is not None) and not self.num_experts:
            raise ConfigError("moe_bias and swiglu_limit are the experts' (num_experts is 0)")
        frequencies = int(self.head_dim * self.rope.partial_rotary_factor) // 2
        if self.rope.rope_type == "longrope" and len(self.rope.short_factor) != frequencies:
            raise ConfigError(f"longrope has {len(self.rope.short_factor)} factors for {frequencies} rotary "
                              "frequencies")
        if self.local_rope is not None and self.layer_windows is None:
            raise ConfigError("local_rope needs layer_windows (the windowed layers are the ones it rotates)")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """A config.json, read by its architecture's family (`jaxllm.models.registry`)."""
        from jaxllm.models.registry import architecture_spec

        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        return architecture_spec(archs[0]).read_config(hf)
