"""Decoder layers that share one structure, kept as one layer module whose parameters carry a leading
``[num_layers]`` axis and run with `jax.lax.scan` (or unrolled over static slices of the stacks).

Scanned, tracing, lowering and compiling a step handle one layer instead of every layer (the cost of a bucket's
build stops growing with depth), and a step passes one stacked array per kind of weight instead of one per
layer. On GPU (`Kernels.layer_loop` "unrolled") a model keeps its layers separate instead
(`LlamaForCausalLM.arrange_layers`): in a scan XLA:GPU copies every layer's dynamic slice out before its GEMM
reads it (each weight crosses HBM three times a step: see `benchmarks/gpu_hlo_report.py`); static slices of the
stacks are fused into the GEMMs' operands, but each layer's GEMM is then a fusion of its own (the slice offsets
differ), compiled and autotuned once per layer; separate layers' GEMMs are one fusion, compiled and autotuned
once. A model whose layers differ (a notebook replaced one) keeps its `nnx.List` and runs unrolled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels import take_layer

LAYERS_AXIS = "layers"  # logical name of the leading axis: never sharded (no sharding rule names it)


@functools.cache
def _stacker(sharding: jax.sharding.Sharding | None) -> Callable:
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)


def _stacked_sharding(sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if isinstance(sharding, NamedSharding):  # the new leading axis is replicated; the others keep their split
        return NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
    return sharding


def _stack(values: list) -> jax.Array | jax.ShapeDtypeStruct:
    """One array [len(values), ...] from equal-shaped ones (abstract in, abstract out). The inputs are deleted
    as soon as the stacked copy exists, so stacking a model costs one parameter's worth of extra memory."""
    first = values[0]
    sharding = _stacked_sharding(getattr(first, "sharding", None))
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(values), *first.shape), first.dtype, sharding=sharding)
    stacked = _stacker(sharding)(*values)
    for v in values:
        if not v.is_deleted():
            v.delete()
    return stacked


@jax.tree_util.register_pytree_node_class
class LayerSlice:
    """Slice `index` of a stacked parameter, not yet taken. Inside the layer loop a layer's parameters hold these: a
    matmul kernel given (stacked, index) reads the slice in place, where an XLA:CPU dot on a dynamic slice of
    the stack copies the slice first (every weight of every layer, every step). Anything else indexes it
    (``var[...]``) and gets the slice as an array."""

    def __init__(self, stacked: jax.Array, index: jax.Array | int):
        self.stacked = stacked  # [num_layers, ...]
        self.index = index  # [] int32 (scanned) or int (unrolled)

    def tree_flatten(self):
        return (self.stacked, self.index), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stacked.shape[1:]

    @property
    def dtype(self):
        return self.stacked.dtype

    def __getitem__(self, key):
        return take_layer(self.stacked, self.index)[key]


def _layer_sharding(sharding: jax.sharding.Sharding | None) -> jax.sharding.Sharding | None:
    if isinstance(sharding, NamedSharding):  # the layer axis goes; the others keep their split
        return NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
    return sharding


@functools.cache
def _splitter(sharding: jax.sharding.Sharding | None, count: int) -> Callable:
    return jax.jit(lambda x: [x[i] for i in range(count)],
                   out_shardings=None if sharding is None else [sharding] * count)


def _split(value, count: int) -> list:
    """A stacked value [count, ...] -> its `count` layers (abstract in, abstract out), placed as the stack was."""
    if isinstance(value, jax.ShapeDtypeStruct):
        part = jax.ShapeDtypeStruct(value.shape[1:], value.dtype, sharding=_layer_sharding(value.sharding))
        return [part] * count
    sharding = _layer_sharding(value.sharding) if isinstance(value.sharding, NamedSharding) else None
    return _splitter(sharding, count)(value)


class StackedLayers(nnx.Module):
    def __init__(self, layer: nnx.Module, num_layers: int):
        """layer: a layer module whose every parameter is stacked [num_layers, ...]."""
        self.layer = layer
        self.num_layers = num_layers

    @classmethod
    def from_layers(cls, layers: list[nnx.Module]) -> StackedLayers | None:
        """Stacks `layers` (their parameters are deleted as they are copied), or None when their structures
        differ (a module replaced, a parameter of another shape or dtype)."""
        splits = [nnx.split(layer) for layer in layers]
        graphdef = splits[0][0]
        flats = [nnx.to_flat_state(state) for _, state in splits]
        shapes = [[(p, v.get_value().shape, v.get_value().dtype) for p, v in flat] for flat in flats]
        if any(g != graphdef for g, _ in splits) or any(s != shapes[0] for s in shapes):
            return None
        stacked = []
        for i, (path, var) in enumerate(flats[0]):
            value = _stack([flat[i][1].get_value() for flat in flats])
            axes = var.get_metadata().get("axes")
            stacked.append((path, var.replace(value, **({"axes": (LAYERS_AXIS, *axes)} if axes else {}))))
        return cls(nnx.merge(graphdef, nnx.from_flat_state(stacked)), len(layers))

    def unstack(self, release: bool = False) -> list[nnx.Module]:
        """The layers as separate modules (copies of their slices). release: each stacked array is deleted once its
        slices exist (this module is then unusable), so unstacking costs one stacked parameter's worth of extra
        memory; else this module is left as it is."""
        graphdef, state = nnx.split(self.layer)
        flat = nnx.to_flat_state(state)
        per_layer: list[list] = [[] for _ in range(self.num_layers)]
        for path, var in flat:
            axes = var.get_metadata().get("axes")
            extra = {"axes": tuple(axes[1:])} if axes else {}
            value = var.get_value()
            for i, part in enumerate(_split(value, self.num_layers)):
                per_layer[i].append((path, var.replace(part, **extra)))
            if release and isinstance(value, jax.Array) and not value.is_deleted():
                value.delete()
        return [nnx.merge(graphdef, nnx.from_flat_state(items)) for items in per_layer]

    def __len__(self) -> int:
        return self.num_layers

    def __getitem__(self, index):
        raise TypeError("the layers are stacked into one scanned module; call model.unstack_layers() to get (and "
                        "edit) separate layers, and model.stack_layers() to stack them again")

    def scan(self, fn: Callable[[nnx.Module, jax.Array, Any, jax.Array | int], tuple[jax.Array, Any]],
             x: jax.Array, carry: Any, unroll: bool = False) -> tuple[jax.Array, Any]:
        """Applies fn(layer, x, carry, index) -> (x, carry) for each layer in order: in a `jax.lax.scan` (fn traced
        once, index a traced int32), or, with `unroll`, in a Python loop (index an int, each parameter a static
        slice of its stack)."""
        graphdef, state = nnx.split(self.layer)
        if unroll:
            for index in range(self.num_layers):
                layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=index: LayerSlice(a, i), state))
                x, carry = fn(layer, x, carry, index)
            return x, carry

        def body(c, index):
            layer_state = jax.tree.map(lambda a: LayerSlice(a, index), state)
            return fn(nnx.merge(graphdef, layer_state), *c, index), None

        (x, carry), _ = jax.lax.scan(body, (x, carry), jnp.arange(self.num_layers, dtype=jnp.int32))
        return x, carry
