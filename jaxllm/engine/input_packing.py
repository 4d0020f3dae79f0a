"""A step's small host inputs as one transfer: the leaves of `StepInputs` that every step builds on the host
(positions, the attention metadata, the sampler's per-row columns and flags...) are written into one byte buffer,
sent as one array, and taken apart inside the step (static slices and bitcasts, which XLA fuses into their
consumers or materialises once a step).

Why: each host array passed to a jitted call is its own host-to-device transfer, with its own buffer and events,
and on a GPU host those cost a decode step several times what one array of the same bytes does
(`benchmarks/dispatch_args.py`; figures in docs/performance.md, H100 run 9), where a batch-1 step's host dispatch
is what it waits for.

Which leaves: those the bucket's empty step builds on the host, except the token ids (a step dispatched before
the previous one is read back takes them from the device). Leaves that are device-resident constants in a step
that needs nothing of them (penalty history, logit bias, grammar masks, prompt targets, image embeddings) pass as
they are, constant or not, so a bucket has one executable whatever its steps ask for.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

ALIGN = 4  # each leaf's bytes start on a 4-byte boundary: a 4-byte leaf is a bitcast of whole rows


@dataclasses.dataclass(frozen=True)
class Slot:
    index: int  # the leaf's position in the flattened inputs
    offset: int  # bytes into the buffer
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @functools.cached_property
    def padding(self) -> bytes:
        """The zero bytes after the leaf's, up to the next slot's ALIGN boundary."""
        return bytes(-self.nbytes % ALIGN)


@dataclasses.dataclass(frozen=True)
class Layout:
    treedef: object  # the structure of the bucket's inputs
    count: int  # their leaves
    slots: tuple[Slot, ...]  # the packed ones
    nbytes: int  # the buffer's size (a multiple of ALIGN)
    rest: tuple[tuple[tuple[int, ...], np.dtype], ...]  # the others' shapes and dtypes, in order

    @functools.cached_property
    def unpacked(self) -> tuple[int, ...]:
        """The positions of the leaves that pass as they are."""
        packed = {slot.index for slot in self.slots}
        return tuple(i for i in range(self.count) if i not in packed)


def layout_of(template) -> Layout:
    """The packed leaves of a bucket's inputs, from its empty step (`template`: a `StepInputs`)."""
    leaves, treedef = jax.tree.flatten(template)
    slots, rest, at = [], [], 0
    for index, leaf in enumerate(leaves):
        if index == 0 or not isinstance(leaf, np.ndarray | np.generic):  # 0: the ids (may come from the device)
            rest.append((tuple(np.shape(leaf)), np.dtype(leaf.dtype)))
            continue
        slot = Slot(index, at, tuple(np.shape(leaf)), np.dtype(leaf.dtype))
        slots.append(slot)
        at += slot.nbytes + len(slot.padding)
    return Layout(treedef, len(leaves), tuple(slots), max(at, ALIGN), tuple(rest))


class InputPacker:
    def __init__(self, template_of: Callable[[tuple[int, int]], object], buckets: list[tuple[int, int]]):
        """template_of(bucket): the bucket's inputs for an empty step (what `layout_of` reads)."""
        self._template_of, self.buckets = template_of, list(buckets)
        self._layouts: dict[tuple[int, int], Layout] = {}

    def layout(self, bucket: tuple[int, int], template=None) -> Layout:
        """template: the bucket's empty-step inputs if the caller has them (else built by `template_of`)."""
        if (layout := self._layouts.get(bucket)) is None:
            layout = self._layouts[bucket] = layout_of(self._template_of(bucket) if template is None else template)
        return layout

    def pack(self, bucket: tuple[int, int], inputs) -> tuple[np.ndarray, tuple]:
        """inputs (a `StepInputs`) -> (the packed leaves' bytes [nbytes] uint8, the other leaves in order)."""
        layout = self.layout(bucket)
        leaves, treedef = jax.tree.flatten(inputs)
        if treedef != layout.treedef:
            raise TypeError(f"step inputs of bucket {bucket} are {treedef}, not {layout.treedef}")
        parts = []  # one bytes object per leaf and its padding, joined once: a step's host cost is per call
        for slot in layout.slots:
            leaf = leaves[slot.index]
            if not isinstance(leaf, np.ndarray | np.generic) or leaf.shape != slot.shape:
                raise TypeError(f"step input {slot.index} of bucket {bucket} is {type(leaf).__name__} "
                                f"{np.shape(leaf)}, not the host array {slot.shape} its layout packs")
            parts += (leaf.tobytes() if leaf.dtype == slot.dtype else leaf.astype(slot.dtype).tobytes(), slot.padding)
        buffer = np.frombuffer(b"".join(parts) or bytes(layout.nbytes), np.uint8)
        return buffer, tuple(leaves[i] for i in layout.unpacked)

    def abstract(self, bucket: tuple[int, int], inputs) -> tuple[jax.ShapeDtypeStruct, tuple]:
        """What `pack` gives, abstract (inputs: the bucket's empty step, as `abstract_args` has it)."""
        layout = self.layout(bucket, inputs)
        leaves = jax.tree.leaves(inputs)
        return jax.ShapeDtypeStruct((layout.nbytes,), np.uint8), tuple(leaves[i] for i in layout.unpacked)

    def unpack(self, buffer: jax.Array, rest: tuple):
        """Inside the step: the inputs `pack` took apart, whole again (their bucket: the one whose layout has
        these shapes)."""
        shapes = tuple((tuple(x.shape), np.dtype(x.dtype)) for x in rest)
        matches = {layout for layout in map(self.layout, self.buckets)
                   if layout.nbytes == buffer.shape[0] and layout.rest == shapes}
        if len(matches) != 1:
            raise ValueError(f"{len(matches)} buckets' layouts match packed inputs of {buffer.shape[0]} bytes and "
                             f"leaves {shapes}")
        layout = matches.pop()
        leaves, unpacked = [], iter(rest)
        slots = {slot.index: slot for slot in layout.slots}
        for index in range(layout.count):
            leaves.append(_decode(buffer, slots[index]) if index in slots else next(unpacked))
        return jax.tree.unflatten(layout.treedef, leaves)


def _decode(buffer: jax.Array, slot: Slot) -> jax.Array:
    raw = buffer[slot.offset:slot.offset + slot.nbytes]
    if slot.dtype == np.bool_:
        return (raw != 0).reshape(slot.shape)
    if slot.dtype.itemsize == 1:
        return jax.lax.bitcast_convert_type(raw, slot.dtype).reshape(slot.shape)
    words = raw.reshape(-1, slot.dtype.itemsize)
    return jax.lax.bitcast_convert_type(words, jnp.dtype(slot.dtype)).reshape(slot.shape)
