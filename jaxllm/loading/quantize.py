"""Quantized weights on the host, between a checkpoint's tensors and the model's parameters: per-channel int8
made from float weights, conversion between formats (`QuantFormat.join` picks a common one when the parts of one
parameter differ), and dequantization back to float when a parameter stays float."""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxllm.models.family import FamilySpec
from pallas_kernels.quantized_matmul.format import GROUP_4BIT, INT8, QuantFormat, QuantizedWeight


@dataclasses.dataclass
class HostQuantized:
    """A checkpoint tensor kept quantized: `weight` in `fmt`, of logical shape [..., out, in]."""
    weight: QuantizedWeight
    fmt: QuantFormat
    shape: tuple[int, ...]

    def map_rows(self, fn) -> HostQuantized:
        """fn applied to each array along their shared leading (row) axes, e.g. a row permutation."""
        w = QuantizedWeight(*(None if a is None else fn(a) for a in self.weight))
        return HostQuantized(w, self.fmt, (*w.data.shape[:-1], self.shape[-1]))


def values(w: QuantizedWeight, fmt: QuantFormat) -> np.ndarray:
    """The integer values [..., in] as int8 (4-bit data unpacked into input order; symmetric 4-bit centred)."""
    if fmt.bits == 8:
        return w.data
    d = w.data.reshape(*w.data.shape[:-1], -1, GROUP_4BIT // 2)
    q = np.concatenate([d & 0x0F, d >> 4], axis=-1).reshape(*w.data.shape[:-1], -1).view(np.int8)
    return q if fmt.affine else q - np.int8(8)


def dequantize(w: QuantizedWeight, fmt: QuantFormat) -> np.ndarray:
    q = values(w, fmt).astype(np.float32)
    groups = w.scale.shape[-1]
    q = q.reshape(*q.shape[:-1], groups, -1)
    v = q * w.scale.astype(np.float32)[..., None]
    if w.offset is not None:
        v += w.offset.astype(np.float32)[..., None]
    return v.reshape(*v.shape[:-2], -1)


def quantize_int8(w: np.ndarray) -> QuantizedWeight:
    """Per-output-channel symmetric int8: scale = max |w| / 127 per row, float32."""
    w = np.asarray(w, np.float32)
    amax = np.abs(w).max(axis=-1, keepdims=True)
    scale = amax / 127.0
    inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    data = np.clip(np.rint(w * inv), -127, 127).astype(np.int8)
    return QuantizedWeight(data, scale.astype(np.float32), None)


def convert(t: HostQuantized | np.ndarray, fmt: QuantFormat | None) -> QuantizedWeight | np.ndarray:
    """A tensor in `fmt` (None: float32): lossless between quantized formats (`fmt` must be `t.fmt` or a join of
    it), int8 made from float, float from anything."""
    if not isinstance(t, HostQuantized):
        if fmt is None:
            return t
        if fmt != INT8:
            raise ValueError(f"float weights are quantized to int8 only, not {fmt.label}")
        return quantize_int8(t)
    if fmt is None:
        return dequantize(t.weight, t.fmt)
    src, w = t.fmt, t.weight
    if src == fmt:
        return w
    if fmt.bits != 8 or (src.group and fmt.group and src.group % fmt.group) or (src.affine and not fmt.affine):
        raise ValueError(f"cannot hold {src.label} in {fmt.label} losslessly")
    rep = src.group // fmt.group
    scale = np.repeat(w.scale, rep, axis=-1).astype(fmt.scale_dtype)
    if fmt.affine:
        offset = np.zeros_like(w.scale) if w.offset is None else w.offset
        offset = np.repeat(offset, rep, axis=-1).astype(fmt.scale_dtype)
    else:
        offset = None
    return QuantizedWeight(np.ascontiguousarray(values(w, src)), scale, offset)


QUANTIZATIONS = ("auto", "none", "int8", "gguf")
def role_of(hf_name: str, spec: FamilySpec) -> str | None:
    """'model.layers.3.self_attn.k_proj.weight' -> 'qkv_proj': the model weight (`QUANTIZABLE`) a checkpoint
    tensor belongs to, by its family's fusions; None for biases, norms and anything else."""
    parts = hf_name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        return None
    module = parts[-2]
    role = spec.fused[module][0] if module in spec.fused else module
    if "experts" in parts[:-2]:
        role = f"experts.{role}"
    return role if role in spec.quantizable else None


def join_plan(formats) -> dict[str, QuantFormat]:
    """(role, format or None) pairs, one per checkpoint tensor -> the plan: each role's common format (a role with
    any float tensor stays float)."""
    seen: dict[str, QuantFormat | None] = {}
    for role, fmt in formats:
        if role is None:
            continue
        seen[role] = fmt if role not in seen else (None if seen[role] is None else seen[role].join(fmt))
    return {role: fmt for role, fmt in seen.items() if fmt is not None}


def int8_plan(tie_word_embeddings: bool) -> dict[str, QuantFormat]:
    roles = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens"]
    return {role: INT8 for role in roles + ([] if tie_word_embeddings else ["lm_head"])}


def plan_label(plan: dict[str, QuantFormat]) -> str:
    """'q4_1 (qkv_proj, o_proj, ...), q8_0 (embed_tokens)' for logs; 'none' for an empty plan."""
    by_label: dict[str, list[str]] = {}
    for role, fmt in sorted(plan.items()):
        by_label.setdefault(fmt.label, []).append(role)
    return ", ".join(f"{label} ({', '.join(roles)})" for label, roles in by_label.items()) or "none"
