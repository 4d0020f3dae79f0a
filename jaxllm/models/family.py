"""A model family as one spec: how its Hugging Face config reads into a `ModelConfig`, the model it builds, and
its weights' names (Hugging Face and GGUF), fusions and quantizable roles. `jaxllm.models.registry` maps each
architecture to its spec; a family is one file in `jaxllm/models/families/` and one line there.

The Llama-shaped decoders (`jaxllm.models.llama.LlamaForCausalLM`: attention with optional biases, q/k norms and
sliding windows, per layer or not; a gated MLP with SiLU or GELU) differ only in their config's defaults and
names, so their specs mostly hold flags; another shape names its own `model` and tables."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from jaxllm.config import ConfigError, ModelConfig, RopeConfig

# GGUF tensor names (llama.cpp's) -> Hugging Face module names, inside a layer ("blk.N.<key>") and outside.
LLAMA_GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
LLAMA_GGUF_TOP_NAMES: Mapping[str, str] = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                                           "output": "lm_head"}
# Checkpoint modules the model keeps fused: module -> (fused parameter, part index); parts per fused parameter.
LLAMA_FUSED: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# The model weights a plan may keep quantized: each is one parameter of every layer, or the embedding / LM head.
LLAMA_QUANTIZABLE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head")
# A mixture of experts' stacked expert weights ([experts, out, in] a layer), named apart from a dense MLP's
EXPERT_QUANTIZABLE = ("experts.gate_up_proj", "experts.down_proj")
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                  "gelu": "gelu"}


@dataclasses.dataclass(frozen=True)
class FamilySpec:
    architecture: str  # Hugging Face `architectures[0]`
    gguf_arch: str | None = None  # `general.architecture` of its GGUF files (None: no GGUF support)
    # Whether a file of `gguf_arch` is this family's, by its metadata, where families share an architecture name
    # (Mixtral's files are llama's with experts); families with a test are tried before those without.
    gguf_when: Callable[[Mapping[str, Any]], bool] | None = None
    # How its config differs from Llama's (read by `read_config`).
    attention_bias_default: bool = False
    o_bias_follows_attention_bias: bool = True
    qk_norm: bool = False
    tie_default: bool = False
    sliding_window_default: bool = False  # whether `sliding_window` applies without `use_sliding_window`
    permuted_qk_in_gguf: bool = False  # llama.cpp reorders q/k rows for interleaved RoPE
    # config.json -> ModelConfig (default: `llama_config`, reading the flags above)
    config_reader: Callable[[dict[str, Any], FamilySpec], ModelConfig] | None = None
    # (GGUF metadata, its architecture name, the ModelConfig fields every family reads) -> the family's own
    # fields, replacing or adding to those (`jaxllm.loading.gguf.gguf_config`)
    gguf_config_reader: Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]] | None = None
    model: Callable | None = None  # the model class (default: LlamaForCausalLM)
    # The decoder layer's parts (default: `jaxllm.models.attention.Attention`, `jaxllm.models.llama.MLP`): each
    # built as factory(cfg, dtype=, rngs=, quant=), e.g. an MLP of experts for a mixture-of-experts family.
    attention: Callable | None = None
    mlp: Callable | None = None
    gguf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=lambda: LLAMA_GGUF_LAYER_NAMES)
    gguf_top_names: Mapping[str, str] = dataclasses.field(default_factory=lambda: LLAMA_GGUF_TOP_NAMES)
    fused: Mapping[str, tuple[str, int]] = dataclasses.field(default_factory=lambda: LLAMA_FUSED)
    # Checkpoint modules that stack several of the parts above in another order (Phi-3's qkv_proj: q, k, v rows
    # one after another), split into those parts as they load: module -> parts in row order.
    split: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    quantizable: tuple[str, ...] = LLAMA_QUANTIZABLE
    # Checkpoint module names -> the model's, one dotted component at a time (Mixtral's `block_sparse_moe` -> `mlp`)
    hf_module_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    # (checkpoint tensors (name, load, source), config) -> the tensors in the model's names and layouts, where the
    # family's checkpoints hold them otherwise (GPT-OSS's [experts, in, out] experts, MXFP4 pairs); applied first
    adapt_tensors: Callable[[Iterable[tuple[str, Callable, str]], ModelConfig],
                            Iterator[tuple[str, Callable, str]]] | None = None

    def hf_name(self, name: str) -> str:
        """A checkpoint tensor's name in the model's module names."""
        if not self.hf_module_names:
            return name
        return ".".join(self.hf_module_names.get(part, part) for part in name.split("."))

    def read_config(self, hf: dict[str, Any]) -> ModelConfig:
        return (self.config_reader or llama_config)(hf, self)

    def model_class(self):
        if self.model is not None:
            return self.model
        from jaxllm.models.llama import LlamaForCausalLM
        return LlamaForCausalLM


def llama_config(hf: dict[str, Any], spec: FamilySpec, **overrides) -> ModelConfig:
    """A Llama-shaped config.json (as transformers writes Llama, Mistral, Qwen2 and Qwen3's) -> ModelConfig;
    `overrides` replace what was read (a family's own fields)."""
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=True is not supported")
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", spec.sliding_window_default) else None
        act = hf.get("hidden_act", "silu")
        if act not in HF_ACTIVATIONS:
            raise ConfigError(f"hidden_act {act!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
        fields = dict(
            architecture=spec.architecture,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope=RopeConfig.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", spec.tie_default)),
            attention_bias=bool(hf.get("attention_bias", spec.attention_bias_default)),
            o_bias=bool(hf.get("attention_bias", False)) and spec.o_bias_follows_attention_bias,
            qk_norm=spec.qk_norm,
            sliding_window=int(sliding) if sliding else None,
            activation=HF_ACTIVATIONS[act],
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
        )
    except KeyError as e:
        raise ConfigError(f"missing the field {e.args[0]!r}") from None
    return ModelConfig(**{**fields, **overrides})
