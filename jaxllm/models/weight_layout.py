"""The CPU int8 kernel's weight layout, applied once after loading: every quantized `Linear` and `Embed` (a tied
LM head: its lookups gather rows out of the groups) whose format and shape allow it gets its arrays interleaved
by 16 rows (`pallas_kernels.quantized_matmul.interleave`) and its format marked so, when the kernels chosen for
the model have loops for that layout (`cpu.X16_ISAS`) and the weights are not split over devices. Experts' stacks
keep row order.

Interleaving permutes values inside each 16-row group and keeps every array's shape, so a model's structure,
buckets and sharding specs do not change; its format is part of the graph definition (the step is traced and
cached for it). A checkpoint is saved in row order only (`jaxllm.loading.checkpoint.save_checkpoint` refuses an
interleaved model)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx

from jaxllm.models.layers import Embed, Linear
from pallas_kernels.quantized_matmul.cpu import X16_ISAS
from pallas_kernels.quantized_matmul.format import QuantizedWeight
from pallas_kernels.quantized_matmul.interleave import interleave, supports


def wants_interleaved(model: nnx.Module) -> bool:
    """Whether the model's kernels read interleaved weights faster: the CPU int8 path has loops for them and the
    model runs on one device."""
    k = model.kernels
    return k.matmul == "cpu" and k.int8_isa in X16_ISAS and k.mesh is None


def _params(m: Linear | Embed) -> list:
    if isinstance(m, Embed):
        return [m.embedding, m.embedding_scale, getattr(m, "embedding_offset", None)]
    return [m.weight, m.weight_scale, m.weight_offset]


def _quantized(model: nnx.Module) -> list:
    return [m for _, m in nnx.iter_modules(model) if isinstance(m, (Linear, Embed)) and m.quant is not None]


def interleave_weights(model: nnx.Module) -> int:
    """Interleaves each eligible linear layer's weight in place (see the module's docstring); returns how many."""
    done = 0
    for m in _quantized(model):
        fmt = m.quant
        params = _params(m)
        arrays = [None if p is None else p.get_value() for p in params]
        if fmt.interleaved or not supports(fmt, arrays[0].shape[-2]):
            continue
        out = interleave(QuantizedWeight(*(None if a is None else np.asarray(a) for a in arrays)), fmt)
        for p, old, new in zip(params, arrays, out, strict=True):
            if p is not None:
                sharding = getattr(old, "sharding", None)
                p.set_value(jax.device_put(new, sharding) if sharding is not None else jax.numpy.asarray(new))
        m.quant = dataclasses.replace(fmt, interleaved=True)
        done += 1
    return done


def has_interleaved(model: nnx.Module) -> bool:
    return any(m.quant.interleaved for m in _quantized(model))
