"""GPT-OSS (gpt-oss-20b, gpt-oss-120b): a mixture of experts in every layer (`jaxllm.models.moe.MoE`) with biases on
the router and the experts and a clamped SwiGLU (`ModelConfig.swiglu_limit`, `swiglu_alpha`); attention with biases,
a learned sink logit per q head in every softmax (`ModelConfig.attention_sinks`), layers alternating between a
128-token window and the whole context (`layer_types`), YaRN RoPE; the router's softmax over its top-k logits (the
top-k of the full softmax renormalised: the same weights).

Its checkpoints hold each layer's experts in one tensor per projection, laid out [experts, in, out]
(`mlp.experts.gate_up_proj`, its gate and up columns interleaved as the model's rows are, and `down_proj`), with
`*_bias` tensors beside them, and name the router `mlp.router`. The released checkpoints store the experts' weights
in MXFP4 (`quantization_config.quant_method` "mxfp4": `*_blocks`, 16 bytes of 32 4-bit E2M1 values low nibble first,
and `*_scales`, one E8M0 power-of-two exponent per 32 values, both [experts, out, in / 32, ...]): they are
dequantized as they load (`mxfp4_dequantize`), and the experts run in the model's dtype.

Its GGUF files (llama.cpp's "gpt-oss") split each layer's experts per projection as the other MoE families' files
do (`ffn_gate_exps`, `ffn_up_exps`, `ffn_down_exps` [experts, out, in], each with its bias), the sinks in
`attn_sinks`, the second norm in `post_attention_norm`; the released models' experts are MXFP4 there too (GGML type
MXFP4: per 32 values an E8M0 byte, then 16 bytes of E2M1 nibbles, values j and j + 16 in byte j), decoded as they
load (`jaxllm.loading.dequantize`). The files hold no SwiGLU limit or alpha: llama.cpp's graph fixes them at 7.0
and 1.702, as the released configs have them, and so does this reader."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.dtypes import E2M1_VALUES
from jaxllm.models.families.gemma2 import gguf_windowed_layers, layer_windows
from jaxllm.models.families.moe_config import MOE_GGUF_LAYER_NAMES, MOE_QUANTIZABLE, moe_config, moe_gguf_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE

EXPERT_PROJECTIONS = ("gate_up_proj", "down_proj")


def read_config(hf: dict[str, Any], spec: FamilySpec) -> ModelConfig:
    method = (hf.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported for GPT-OSS (mxfp4 is, "
                          "dequantized as it loads)")
    limit = hf.get("swiglu_limit", 7.0)
    return moe_config(hf, spec, width_key="intermediate_size", norm_topk_default=True,
                      layer_windows=layer_windows(hf, 2), attention_sinks=True, moe_bias=True,
                      swiglu_limit=None if limit is None else float(limit),
                      swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)))


LLAMA_CPP_SWIGLU = (7.0, 1.702)  # (limit, alpha): llama.cpp's graph fixes them for "gpt-oss" files


def read_gguf(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A "gpt-oss" file's metadata as llama.cpp reads it: every other layer windowed, the first one first (unless
    `attention.sliding_window_pattern` says otherwise), the router's softmax over its top-k, the SwiGLU constants
    of llama.cpp's graph; its YaRN correction range rounded outward (llama.cpp's, `RopeConfig.truncate`)."""
    window = fields["sliding_window"]
    windowed = gguf_windowed_layers(meta, arch, fields["num_layers"], 2)
    if window is None and any(windowed):
        raise ConfigError(f"metadata {arch}.attention.sliding_window is missing")
    limit, alpha = LLAMA_CPP_SWIGLU
    return dict(moe_gguf_config(meta, arch, fields, norm_topk_prob=True), sliding_window=None,
                layer_windows=tuple(window if w else 0 for w in windowed), attention_sinks=True, moe_bias=True,
                swiglu_limit=limit, swiglu_alpha=alpha)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8 (two E2M1 values a byte, the low nibble first), scales [..., G] uint8 (E8M0: the
    power of two 2^(s - 127)) -> float32 [..., G * 32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair (blocks [..., G, 16], "
                         "scales [..., G])")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = E2M1_VALUES[blocks & 0x0F]
    values[..., 1::2] = E2M1_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def _transposed(load: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """[experts, in, out] -> [experts, out, in] (the model's layout, as every other family's experts)."""
    return lambda: np.ascontiguousarray(np.swapaxes(np.asarray(load()), -1, -2))


def _dequantized(blocks: Callable[[], np.ndarray], scales: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    return lambda: mxfp4_dequantize(blocks(), scales())


def adapt_tensors(tensors: Iterable[tuple[str, Callable, str]], cfg: ModelConfig
                  ) -> Iterator[tuple[str, Callable, str]]:
    """The checkpoint's expert tensors in the model's names and layout: `experts.gate_up_proj` [E, in, out] ->
    `experts.gate_up_proj.weight` [E, out, in], `experts.gate_up_proj_bias` -> `experts.gate_up_proj.bias`, an
    MXFP4 pair (`_blocks`, `_scales`, already [E, out, ...]) -> the dequantized weight. The rest pass as they are.
    A load is read whole (no windowed reads for another host's share: these tensors are transposed or decoded)."""
    pending: dict[str, dict[str, tuple[Callable, str]]] = {}  # an MXFP4 weight's half seen so far
    for name, load, source in tensors:
        if name.endswith(".self_attn.sinks.weight"):  # a GGUF file's `attn_sinks.weight`
            name = name.removesuffix(".weight")
        head, _, last = name.rpartition(".")
        if not head.endswith(".experts"):
            yield name, load, source
            continue
        if last in EXPERT_PROJECTIONS:
            yield f"{name}.weight", _transposed(load), source
        elif last.endswith("_bias") and last[:-5] in EXPERT_PROJECTIONS:
            yield f"{head}.{last[:-5]}.bias", load, source
        elif last.rpartition("_")[0] in EXPERT_PROJECTIONS and last.rpartition("_")[2] in ("blocks", "scales"):
            proj, _, kind = last.rpartition("_")
            halves = pending.setdefault(f"{head}.{proj}", {})
            halves[kind] = (load, source)
            if len(halves) == 2:
                del pending[f"{head}.{proj}"]
                yield f"{head}.{proj}.weight", _dequantized(halves["blocks"][0], halves["scales"][0]), source
        else:
            yield name, load, source
    for weight, halves in pending.items():
        (_, source), = halves.values()
        missing = "scales" if "blocks" in halves else "blocks"
        from jaxllm.loading.errors import LoadError  # here: jaxllm.loading imports the registry, which imports this

        raise LoadError(f"{source}: MXFP4 weight {weight!r} has no {weight.rpartition('.')[2]}_{missing} tensor")


SPEC = FamilySpec("GptOssForCausalLM", gguf_arch="gpt-oss", attention_bias_default=True, config_reader=read_config,
                  mlp=MoE, quantizable=MOE_QUANTIZABLE, hf_module_names={"router": "gate"}, adapt_tensors=adapt_tensors,
                  gguf_config_reader=read_gguf,
                  gguf_layer_names={**MOE_GGUF_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                                    "attn_sinks": "self_attn.sinks"})
