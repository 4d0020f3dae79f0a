"""LoRA in the model: each targeted linear layer holds a fixed table of adapter slots, and a step applies to every
token the adapter of its slot, ``y = x W^T + (x A_s^T) B_s^T`` (the adapter's scale folded into B), for a ragged
batch where neighbouring tokens may use different adapters.

A table is ``a [slots, parts * rank, in]`` and ``b [slots, rank, out]`` (B transposed: a rank's weights for every
output row contiguous, so that a kernel sums the rank's terms into whole output rows at once): a fused projection
(q/k/v, gate/up) holds its parts' ranks side by side in A, and each of its output columns of B (in the fused
layout) holds the B row of the part it belongs to (`row_parts`; `jaxllm.lora.layout` packs them): no block of
zeros is stored or read. Slot -1 is "no adapter". The engine writes adapters into slots between steps (same
shapes: nothing recompiles); the step gets each token's slot ([T] int32).

A step of at most as many tokens as slots (a decode step of few sequences) gathers each token's own A and B and
reads nothing else of the tables (on CPU every step runs `pallas_kernels.lora_delta`'s kernel,
which reads each token's slot in place; a quantized layer's decode-sized steps run it in the int8 matmul's own
call, `fused_matmul`); a larger step runs the product over every slot with a one-hot mask (each
token's row of ``x A^T`` kept for its own slot only, the others exact zeros), its cost the slot count times the
rank, small next to the base matmul there. Either way a row's result depends on its own input and slot alone,
not on the other rows' values, though the two paths may round differently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxllm.config import ModelConfig
from jaxllm.dtypes import LORA_DTYPES
from pallas_kernels import dot_precision
from pallas_kernels.lora_delta import cpu as lora_cpu
from pallas_kernels.lora_delta.reference import lora_delta as reference_delta

# PEFT's module name -> (the model's linear layer, its part of a fused one)
TARGETS: dict[str, tuple[str, str | None]] = {
    "q_proj": ("self_attn.qkv_proj", "q"), "k_proj": ("self_attn.qkv_proj", "k"),
    "v_proj": ("self_attn.qkv_proj", "v"), "o_proj": ("self_attn.o_proj", None),
    "gate_proj": ("mlp.gate_up_proj", "gate"), "up_proj": ("mlp.gate_up_proj", "up"),
    "down_proj": ("mlp.down_proj", None)}
PARTS: dict[str, tuple[str | None, ...]] = {  # each LoRA-capable linear's parts, in table order
    "self_attn.qkv_proj": ("q", "k", "v"), "self_attn.o_proj": (None,),
    "mlp.gate_up_proj": ("gate", "up"), "mlp.down_proj": (None,)}


class LoRATable(nnx.Variable):
    """An adapter slot table (not a checkpoint parameter: the engine writes it)."""


def linear_shape(cfg: ModelConfig, linear: str) -> tuple[int, int]:
    """(out, in) of a LoRA-capable linear layer."""
    q, kv, e, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, \
        cfg.intermediate_size
    return {"self_attn.qkv_proj": (q + 2 * kv, e), "self_attn.o_proj": (e, q),
            "mlp.gate_up_proj": (2 * f, e), "mlp.down_proj": (e, f)}[linear]


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a PEFT target module (`TARGETS`), as a checkpoint stores it before fusing."""
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out, inp = linear_shape(cfg, TARGETS[module][0])
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": f, "up_proj": f}.get(module, out), inp


def _module(layer: nnx.Module, dotted: str):
    for name in dotted.split("."):
        layer = getattr(layer, name, None)
        if layer is None:
            return None
    return layer


def table_dtype(lora_dtype: str, model_dtype, quantized: bool):
    """The tables' dtype for a layer: `lora_dtype`, or for "auto" the model's dtype, except bfloat16 where the
    layer's weight is kept quantized (4 to 8 bits a weight: a 16-bit adapter is finer than the base it corrects,
    and adapters are commonly trained and saved in bfloat16; a single stream's step streams its adapter's tables
    beside the base's bytes: float32 tables of rank 16 add ~20 MB to the embedded model's ~95 MB, counted from the
    shapes)."""
    if lora_dtype != "auto":
        return LORA_DTYPES[lora_dtype]
    return jnp.bfloat16 if quantized else model_dtype


def enable(model, max_loras: int, max_rank: int, lora_dtype: str = "auto") -> None:
    """Gives every LoRA-capable linear layer of `model`'s decoder layers an all-zero table of `max_loras` slots of
    rank `max_rank` (in `table_dtype`). A mixture-of-experts MLP has no LoRA-capable projections."""
    if max_loras < 1 or max_rank < 1:
        raise ValueError(f"max_loras and max_lora_rank must be at least 1, got {max_loras} and {max_rank}")
    stacked = model.stacked
    model.unstack_layers()
    cfg = model.config
    for layer in model.layers:
        for linear, parts in PARTS.items():
            module = _module(layer, linear)
            if module is None or not hasattr(module, "lora_rank"):
                continue
            out, inp = linear_shape(cfg, linear)
            width = len(parts) * max_rank
            a_spec, b_spec = _table_specs(module.weight.get_value())
            dtype = table_dtype(lora_dtype, model.dtype, module.quant is not None)
            module.lora_a = LoRATable(_zeros((max_loras, width, inp), dtype, a_spec))
            module.lora_b = LoRATable(_zeros((max_loras, max_rank, out), dtype, b_spec))
            module.lora_rank = max_rank
            module.lora_fused = fused_layout(cfg, linear)
    if stacked:
        model.stack_layers()


def fused_layout(cfg: ModelConfig, linear: str) -> tuple[int, ...] | None:
    """How a fused layer's output rows interleave its parts (static, hashable): q/k/v (kv_heads, group, head_dim),
    gate/up (mlp,); None: not fused."""
    if linear == "self_attn.qkv_proj":
        return cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    if linear == "mlp.gate_up_proj":
        return (cfg.intermediate_size,)
    return None


def row_parts(fused: tuple[int, ...] | None) -> np.ndarray | None:
    """[out] int32: the part (index into `PARTS`' tuple) each output row of a fused layer belongs to; q/k/v rows are
    ``[kv_heads, group + 2, head_dim]`` (`jaxllm.models.attention`), gate/up rows ``[mlp, 2]``."""
    if fused is None:
        return None
    if len(fused) == 3:
        kvh, group, d = fused
        per_head = np.concatenate([np.zeros(group * d), np.full(d, 1), np.full(d, 2)])
        return np.tile(per_head, kvh).astype(np.int32)
    return np.tile(np.arange(2), fused[0]).astype(np.int32)


def _table_specs(weight: jax.Array) -> tuple[NamedSharding | None, NamedSharding | None]:
    """The tables' shardings under tensor parallelism (None: one device): A [S, R, in] split as the weight's input
    axis, B [S, R, out] as its output axis, so that each device's share of the adapter term is the share of the
    output it computes (a row-parallel layer's partial x A^T is summed by GSPMD, as its base product is)."""
    sharding = getattr(weight, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.size == 1:
        return None, None
    spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
    out_axis, in_axis = spec  # (packed 4-bit rows [out, in / 2] split as their input is: by whole blocks)
    mesh = sharding.mesh
    return (NamedSharding(mesh, PartitionSpec(None, None, in_axis)),
            NamedSharding(mesh, PartitionSpec(None, None, out_axis)))


def _zeros(shape: tuple[int, ...], dtype, sharding: NamedSharding | None) -> jax.Array:
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.device_put(np.zeros(shape, jnp.dtype(dtype)), sharding)


def delta(x: jax.Array, a, b, slots: jax.Array, fused: tuple[int, ...] | None = None, matmul: str = "reference"
          ) -> jax.Array:
    """x [T, in], a [S, P * R, in], b [S, R, out] (or a scanned layer's `LayerSlice` of them), slots [T] int32 (-1:
    none) -> [T, out]: each row's adapter term. fused: the layer's `fused_layout` (P parts), None for one part;
    matmul: the layer's matmul implementation (``cpu``: the CPU kernel of `pallas_kernels.lora_delta` for the
    steps it takes)."""
    p = dot_precision(x)
    parts = row_parts(fused)
    rank = b.shape[-2]
    (a_stack, layer), (b_stack, _) = _stack(a), _stack(b)
    if matmul == "cpu" and lora_cpu.applies(x, a_stack, b_stack):  # the tables read in place
        return lora_cpu.lora_delta(x, a_stack, b_stack, layer, slots, parts)
    if x.shape[0] <= a_stack.shape[1]:  # each token's own adapter only
        return reference_delta(x, a_stack, b_stack, layer, slots, parts)
    a, b = a[...], b[...]
    u = jnp.einsum("ti,sri->tsr", x, a.astype(x.dtype), precision=p)  # [T, S, P * R]
    mine = slots[:, None] == jnp.arange(a.shape[0], dtype=slots.dtype)  # [T, S]
    u = jnp.where(mine[:, :, None], u, jnp.zeros_like(u))
    if parts is not None:  # B block-diagonal again, for one product over every slot: [S, P * R, out]
        width = u.shape[-1]
        own = np.arange(width)[:, None] // rank == parts[None, :]  # [P * R, out]
        b = jnp.where(own[None], jnp.tile(b, (1, width // rank, 1)), jnp.zeros((), b.dtype))
    return jnp.einsum("tsr,sro->to", u, b.astype(x.dtype), precision=p)


def fused_matmul(kernels, x: jax.Array, fmt, w, layer: jax.Array | None, a, b, slots: jax.Array,
                 fused: tuple[int, ...] | None) -> jax.Array | None:
    """A quantized layer's product and adapter term in one CPU kernel call (`pallas_kernels.lora_delta.cpu_fused`)
    where both CPU kernels would run, else None. w: the weight's `QuantizedWeight`, layer stacks read at `layer`
    (None: a layer's own arrays)."""
    if kernels.matmul != "cpu":
        return None
    from pallas_kernels.lora_delta import cpu_fused
    (a_stack, lora_layer), (b_stack, _) = _stack(a), _stack(b)
    x2 = x.reshape(-1, x.shape[-1])
    if not cpu_fused.applies(x2, fmt, kernels.int8_isa, a_stack, b_stack):
        return None
    if layer is None:  # a stack of one, as `_stack` gives a table's
        w, layer = jax.tree.map(lambda v: v[None], w), 0
    y = cpu_fused.matmul(x2, w, fmt, layer, a_stack, b_stack, lora_layer, slots, row_parts(fused),
                         isa=kernels.int8_isa)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _stack(table) -> tuple[jax.Array, jax.Array | int]:
    """(a layer stack [L, ...], the layer's index): a scanned layer's `LayerSlice` as the kernels read it in place (a
    slice of the layer first would copy every slot), a separate layer's table as a stack of one."""
    from jaxllm.models.stacked_layers import LayerSlice

    if isinstance(table, LayerSlice):
        return table.stacked, table.index
    return table[None], 0
