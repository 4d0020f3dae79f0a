"""GGUF checkpoints: model config from metadata, tensors renamed to Hugging Face names and dequantized."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np

from jaxllm.config import ConfigError, ModelConfig, RopeConfig
from jaxllm.loading.errors import LoadError
from jaxllm.loading.gguf_file import GGUFFile
from jaxllm.loading.gguf_quant import FORMATS
from jaxllm.loading.quantize import join_plan, role_of
from jaxllm.models.family import FamilySpec
from jaxllm.models.registry import architecture_spec, gguf_architectures, gguf_spec
from pallas_kernels.quantized_matmul import QuantFormat


def gguf_to_hf_name(name: str, spec: FamilySpec) -> str | None:
    """A GGUF tensor name -> the Hugging Face name it loads as, by the family's tables (None: not a model
    tensor)."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        layer, part, kind = m.groups()
        hf = spec.gguf_layer_names.get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        hf = spec.gguf_top_names.get(m[1])
        return f"{hf}.{m[2]}" if hf else None
    return None


def gguf_family(g: GGUFFile) -> FamilySpec:
    arch = g.metadata.get("general.architecture")
    spec = gguf_spec(arch, g.metadata)
    if spec is None:
        known = gguf_architectures()
        raise LoadError(f"{g.path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(known))}")
    return spec


def gguf_config(g: GGUFFile) -> ModelConfig:
    meta = g.metadata
    arch = meta.get("general.architecture")
    spec = gguf_family(g)
    name = spec.architecture

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise LoadError(f"{g.path}: metadata {arch}.{key} is missing")
        return value

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    rope_kwargs: dict = {"theta": float(get("rope.freq_base", 10000.0))}
    if scaling in ("linear", "yarn"):
        rope_kwargs.update(rope_type=scaling, factor=float(get("rope.scaling.factor")))
        if scaling == "yarn":
            rope_kwargs["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
            for beta in ("beta_fast", "beta_slow"):  # (llama.cpp's defaults where absent: RopeConfig's)
                if (value := meta.get(f"{arch}.rope.scaling.yarn_{beta}")) is not None:
                    rope_kwargs[beta] = float(value)
    elif scaling != "none":
        raise LoadError(f"{g.path}: unsupported rope scaling type {scaling!r}")
    head_dim = int(get("attention.key_length", hidden // heads))
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary and int(rotary) != head_dim:  # Phi-3.5 / Phi-4-mini rotate a leading share of each head
        rope_kwargs["partial_rotary_factor"] = int(rotary) / head_dim
    if "rope_freqs.weight" in g.tensors:
        rope_kwargs["freq_factors"] = tuple(float(x) for x in g.load("rope_freqs.weight"))
    if LONGROPE_TENSORS[0] in g.tensors or LONGROPE_TENSORS[1] in g.tensors:
        rope_kwargs.update(_longrope(g, get))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", []))
    eos = meta.get("tokenizer.ggml.eos_token_id")
    sliding = meta.get(f"{arch}.attention.sliding_window")
    try:
        fields = dict(
            architecture=name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            max_position_embeddings=int(get("context_length", 4096)),
            rope=RopeConfig(**rope_kwargs),
            tie_word_embeddings="output.weight" not in g.tensors,
            attention_bias="blk.0.attn_q.bias" in g.tensors,
            o_bias="blk.0.attn_output.bias" in g.tensors,
            qk_norm=spec.qk_norm,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=(int(eos),) if eos is not None else (),
        )
        if spec.gguf_config_reader is not None:
            fields.update(spec.gguf_config_reader(meta, arch, fields))
        return ModelConfig(**fields)
    except ConfigError as e:
        raise LoadError(f"{g.path}: {e}") from None


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _longrope(g: GGUFFile, get) -> dict:
    """LongRoPE (Phi-3's 128k variants) as llama.cpp's converter stores it: the two factor sets as tensors, the
    original context length and the attention factor in the metadata; the set the model runs is chosen by its
    context length (`LlamaForCausalLM.set_context_length`, as llama.cpp chooses by its context size)."""
    missing = [t for t in LONGROPE_TENSORS if t not in g.tensors]
    if missing:
        raise LoadError(f"{g.path}: LongRoPE needs both factor tensors; {missing[0]!r} is missing")
    long, short = (tuple(float(x) for x in g.load(t)) for t in LONGROPE_TENSORS)
    original = int(get("rope.scaling.original_context_length"))
    out = dict(rope_type="longrope", long_factor=long, short_factor=short, original_max_position_embeddings=original,
               factor=max(1.0, int(get("context_length")) / original))
    attention = g.metadata.get(f"{g.metadata['general.architecture']}.rope.scaling.attn_factor")
    if attention is not None:
        out["attention_factor"] = float(attention)
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's row order for interleaved RoPE, back to Hugging Face's rotate-half order."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_quant_plan(g: GGUFFile) -> dict[str, QuantFormat]:
    """The weights a GGUF file keeps quantized, each in the one format that holds all its tensors (a Q4_K_M file
    mixes Q4_K and Q6_K in some weights: those become 8-bit, `QuantFormat.join`)."""
    spec = gguf_family(g)
    return join_plan((role_of(hf, spec) if (hf := gguf_to_hf_name(name, spec)) else None, FORMATS.get(info.qtype))
                     for name, info in g.tensors.items())


def gguf_tensors(g: GGUFFile, cfg: ModelConfig, quantized: bool = False) -> Iterator[tuple[str, object, str]]:
    """(hf_name, load, source) per tensor; load() dequantizes to float, or with `quantized` returns the
    quantized types' blocks repacked (`HostQuantized`)."""
    spec = architecture_spec(cfg.architecture)
    permuted = spec.permuted_qk_in_gguf
    for name in g.tensors:
        hf_name = gguf_to_hf_name(name, spec)
        if hf_name is None:
            if name not in ("rope_freqs.weight", *LONGROPE_TENSORS):
                raise LoadError(f"{g.path}: unexpected tensor {name!r}")
            continue
        module = ".".join(hf_name.split(".")[-3:-1])  # e.g. "self_attn.q_proj"
        heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}.get(module) \
            if permuted else None

        keep = quantized and g.tensors[name].qtype in FORMATS

        def load(name=name, heads=heads, keep=keep):
            if keep:
                w = g.load_quantized(name)
                return w.map_rows(lambda a: _unpermute(a, heads)) if heads else w
            w = g.load(name)
            return _unpermute(w, heads) if heads else w

        yield hf_name, load, str(g.path)
