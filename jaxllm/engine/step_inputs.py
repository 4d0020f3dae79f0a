"""A step's small host inputs packed into one buffer per dtype, so a step transfers a handful of arrays.

A step's inputs are a pytree of ~25 arrays built on the host every step (token ids, positions, attention metadata,
the sampler's per-row settings); handing them to the executable one by one cost ~0.15 ms of a ~6 ms single-stream
CPU step in transfers alone, and each one is a separate host-to-device copy on an accelerator. `InputLayout`
concatenates them into one flat buffer per dtype on the host and slices them back apart inside the jitted step
(static offsets: free for XLA). Which leaves are packed is fixed per bucket (the leaves an empty step builds on
the host): the large, mostly unused ones (penalty history, logit-bias and grammar-mask tables) stay device-resident
arrays reused from step to step, and pass through unpacked even on the steps that build them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np


def _is_host(leaf) -> bool:
    return isinstance(leaf, np.ndarray | np.generic)


@dataclasses.dataclass(frozen=True)
class InputLayout:
    """Where each leaf of a bucket's inputs goes: a slice of one dtype's buffer, or a pass-through argument."""
    treedef: jax.tree_util.PyTreeDef
    dtypes: tuple[np.dtype, ...]  # one buffer per dtype, in this order
    groups: tuple[tuple[int, ...], ...]  # per buffer: the indices of its leaves, in buffer order
    passed: tuple[int, ...]  # the indices of the pass-through leaves
    # per leaf: (buffer index, offset, shape) if packed, else (-1, pass-through index, ())
    places: tuple[tuple[int, int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, inputs) -> InputLayout:
        """The layout of `inputs` (an empty step's: its host-built leaves are every step's)."""
        leaves, treedef = jax.tree.flatten(inputs)
        dtypes = tuple(dict.fromkeys(np.asarray(x).dtype for x in leaves if _is_host(x)))
        groups: list[list[int]] = [[] for _ in dtypes]
        sizes, places, passed = [0] * len(dtypes), [], []
        for i, leaf in enumerate(leaves):
            if _is_host(leaf):
                b = dtypes.index(np.asarray(leaf).dtype)
                groups[b].append(i)
                places.append((b, sizes[b], tuple(np.shape(leaf))))
                sizes[b] += int(np.size(leaf))
            else:
                places.append((-1, len(passed), ()))
                passed.append(i)
        return cls(treedef, dtypes, tuple(map(tuple, groups)), tuple(passed), tuple(places))

    def pack(self, inputs) -> tuple[list[np.ndarray], list]:
        """(one flat buffer per dtype, the pass-through leaves) of a step's `inputs`."""
        leaves = self.treedef.flatten_up_to(inputs)
        buffers = [np.concatenate([np.ravel(leaves[i]) for i in group]) for group in self.groups]
        return buffers, [leaves[i] for i in self.passed]

    def unpack(self, buffers, passed):
        """The inputs' pytree again, inside the jitted step."""
        leaves = [passed[at] if b < 0 else buffers[b][at:at + math.prod(shape)].reshape(shape)
                  for b, at, shape in self.places]
        return jax.tree.unflatten(self.treedef, leaves)
