"""Runs the vision encoder on the images a step needs, before the step: the images are packed into runs of at most
the largest bucket's tokens, each run padded to a fixed bucket of patch counts (compiled at start-up like the
step's buckets, so no image size compiles anything while serving). Padding patches form an image of their own:
they attend only to each other, and their outputs are dropped."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxllm.multimodal.inputs import ImageItem


def _encode(graphdef, state_def, params, rows, layout):
    encoder = nnx.merge(graphdef, jax.tree.unflatten(state_def, params))
    return encoder.features(rows, layout)


def default_encoder_buckets(max_tokens: int, smallest: int = 64) -> list[int]:
    """Powers of two of image tokens from `smallest` up to the first that holds max_tokens."""
    out = [smallest]
    while out[-1] < max_tokens:
        out.append(out[-1] * 2)
    return out


class EncoderRunner:
    def __init__(self, encoder: nnx.Module, buckets: list[int]):
        """encoder: a vision encoder (`layout(grids)` on the host, `features(rows, layout)` -> [levels, tokens, E]);
        buckets: image tokens per encoder run (the patch count is merge_unit times that)."""
        self.config = encoder.config
        self._layout = encoder.layout
        graphdef, state = nnx.split(encoder)
        self.params, state_def = jax.tree.flatten(state)
        self._jit = jax.jit(functools.partial(_encode, graphdef, state_def))
        self.buckets = sorted(buckets)
        self._executables: dict[int, jax.stages.Compiled] = {}
        self.runs = 0

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def _inputs(self, images: list[tuple[np.ndarray, tuple[int, int, int]]], bucket: int):
        cfg = self.config
        m, unit = cfg.spatial_merge_size, cfg.merge_unit
        tokens = sum(len(r) for r, _ in images) // unit
        rows = np.zeros((bucket * unit, cfg.patch_dim), np.float32)
        at = 0
        for r, _ in images:
            rows[at:at + len(r)] = r
            at += len(r)
        grids = [g for _, g in images]
        if bucket > tokens:  # the padding as one image of (m, (bucket - tokens) * m) patches
            grids.append((1, m, (bucket - tokens) * m))
        return rows, self._layout(grids)

    def _executable(self, bucket: int) -> jax.stages.Compiled:
        run = self._executables.get(bucket)
        if run is None:
            rows, layout = self._inputs([], bucket)
            run = self._executables[bucket] = self._jit.lower(self.params, rows, layout).compile()
        return run

    def warmup(self) -> None:
        for bucket in tqdm(self.buckets, desc="building encoder buckets", unit="bucket"):
            rows, layout = self._inputs([], bucket)
            jax.block_until_ready(self._executable(bucket)(self.params, rows, layout))

    def encode(self, images: list[ImageItem]) -> list[np.ndarray]:
        """Each image's embeddings [levels, num_tokens, out_hidden_size] (float32, host), in order."""
        out: list[np.ndarray] = []
        group: list[ImageItem] = []
        for im in images:
            if im.num_tokens > self.max_tokens:
                raise ValueError(f"an image of {im.num_tokens} tokens exceeds the encoder's {self.max_tokens}")
            if sum(g.num_tokens for g in group) + im.num_tokens > self.max_tokens:
                out += self._run(group)
                group = []
            group.append(im)
        return out + self._run(group) if group else out

    def _run(self, group: list[ImageItem]) -> list[np.ndarray]:
        tokens = sum(im.num_tokens for im in group)
        bucket = next(b for b in self.buckets if b >= tokens)
        rows, layout = self._inputs([(im.rows, im.grid) for im in group], bucket)
        embeds = np.asarray(self._executable(bucket)(self.params, rows, layout))  # [levels, bucket, E]
        self.runs += 1
        bounds = np.cumsum([0] + [im.num_tokens for im in group])
        return [embeds[:, a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
