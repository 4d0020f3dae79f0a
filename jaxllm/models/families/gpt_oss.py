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
dequantized as they load (`mxfp4_dequantize`), and the experts run in the model's dtype."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.models.families.gemma2 import layer_windows
from jaxllm.models.families.moe_config import MOE_QUANTIZABLE, moe_config
from jaxllm.models.family import FamilySpec
from jaxllm.models.moe import MoE

# E2M1: sign, two exponent bits, one mantissa bit (the OCP MX spec's FP4), by nibble value
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
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


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8 (two E2M1 values a byte, the low nibble first), scales [..., G] uint8 (E8M0: the
    power of two 2^(s - 127)) -> float32 [..., G * 32]."""
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not pair (blocks [..., G, 16], "
                         "scales [..., G])")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
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


SPEC = FamilySpec("GptOssForCausalLM", attention_bias_default=True, config_reader=read_config, mlp=MoE,
                  quantizable=MOE_QUANTIZABLE, hf_module_names={"router": "gate"}, adapt_tensors=adapt_tensors)
