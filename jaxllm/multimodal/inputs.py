"""A prompt's images as the engine core sees them: each image's patch rows, grid and content hash, where its run of
image-pad tokens sits in the prompt, and the prompt's multimodal rotary positions.

`MultiModalSpec` (what a vision-language model accepts: its preprocessing, its image token, the per-prompt limits)
turns a prompt holding one image-pad token per image and the images themselves into the expanded prompt and its
`MultiModalInputs`. The spec is plain data: the engine core sends it to API servers at the handshake, so images
are decoded and preprocessed in the API processes, and the core rebuilds (and so re-checks) the inputs from the
rows and grids it receives (`MultiModalInputs.build`): the hash that keys the encoder and prefix caches is always
computed by the core, from the pixels, never taken from a message.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np

from jaxllm.errors import InvalidRequestError
from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess


@dataclasses.dataclass(frozen=True)
class ImageItem:
    rows: np.ndarray  # [patches, patch_dim] float32, the image processor's order
    grid: tuple[int, int, int]  # (t, h, w) patches
    offset: int  # where its image-pad run starts in the prompt
    num_tokens: int  # its image-pad tokens (patches / merge_size**2)
    hash: bytes  # SHA-256 of the grid and rows: the encoder cache's key, mixed into prefix-cache page hashes

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def image_hash(rows: np.ndarray, grid: tuple[int, int, int]) -> bytes:
    h = hashlib.sha256(b"jaxllm image v1")
    h.update(np.asarray(grid, np.int64).tobytes())
    h.update(np.ascontiguousarray(rows, np.float32).tobytes())
    return h.digest()


@dataclasses.dataclass(frozen=True)
class MultiModalInputs:
    images: tuple[ImageItem, ...]
    positions: np.ndarray  # [3, prompt tokens] int32 M-RoPE positions
    delta: int  # a generated token at index j sits at position j + delta on every axis

    def position_rows(self, start: int, n: int) -> np.ndarray:
        """[3, n] positions of tokens start..start+n-1 (prompt or generated)."""
        prompt = self.positions.shape[1]
        out = np.empty((3, n), np.int32)
        k = max(0, min(n, prompt - start))
        out[:, :k] = self.positions[:, start:start + k]
        out[:, k:] = np.arange(start + k, start + n, dtype=np.int32) + self.delta
        return out

    def images_in(self, start: int, end: int) -> list[ImageItem]:
        """The images with tokens in [start, end)."""
        return [im for im in self.images if im.offset < end and im.end > start]

    @classmethod
    def build(cls, ids: list[int], rows: list[np.ndarray], grids: list[tuple[int, int, int]],
              spec: MultiModalSpec) -> MultiModalInputs:
        """From an expanded prompt and its images' patch rows and grids; checks that they agree (a run of
        image-pad tokens per image, of its size, in order, and nothing else holding image-pad tokens)."""
        from jaxllm.models.qwen_vl import mrope_positions

        if len(rows) != len(grids):
            raise InvalidRequestError("every image needs its rows and its grid", "multi_modal_data")
        arr = np.asarray(ids)
        starts = np.flatnonzero((arr == spec.image_token_id) & np.r_[True, arr[:-1] != spec.image_token_id])
        items, at = [], 0
        for r, g in zip(rows, grids, strict=True):
            g = tuple(int(x) for x in g)
            r = np.asarray(r, np.float32)
            if len(g) != 3 or min(g) < 1 or g[1] % spec.merge or g[2] % spec.merge or r.ndim != 2 or \
                    r.shape != (g[0] * g[1] * g[2], spec.patch_dim):
                raise InvalidRequestError(f"image rows {r.shape} do not fit grid {g}", "multi_modal_data")
            n = g[0] * (g[1] // spec.merge) * (g[2] // spec.merge)
            if n > spec.max_image_tokens:
                raise InvalidRequestError(f"an image of {n} tokens; at most {spec.max_image_tokens} are allowed",
                                          "multi_modal_data")
            if at >= len(starts):
                raise InvalidRequestError(f"the prompt has {len(starts)} image placeholders for {len(rows)} images",
                                          "multi_modal_data")
            offset = int(starts[at])
            if not np.all(arr[offset:offset + n] == spec.image_token_id) or \
                    (offset + n < len(arr) and arr[offset + n] == spec.image_token_id):
                raise InvalidRequestError(f"image {at} needs exactly {n} image tokens in a row", "multi_modal_data")
            items.append(ImageItem(r, g, offset, n, image_hash(r, g)))
            at += 1
        if at != len(starts):
            raise InvalidRequestError(f"the prompt has {len(starts)} image placeholders for {len(rows)} images",
                                      "multi_modal_data")
        positions = mrope_positions(arr, [im.grid for im in items], spec.image_token_id, spec.merge)
        return cls(tuple(items), positions, int(positions.max()) + 1 - len(ids))

    def to_wire(self) -> list:
        """[[rows as float32 bytes, grid], ...]: what an API server sends the engine core (`images_from_wire`)."""
        return [[im.rows.tobytes(), list(im.grid)] for im in self.images]


def images_from_wire(value: Any, patch_dim: int) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """`MultiModalInputs.to_wire` -> (rows, grid) pairs, for `Frontend.prepare_prompt` to check and rebuild."""
    try:
        return [(np.frombuffer(b, np.float32).reshape(-1, patch_dim), tuple(int(x) for x in g)) for b, g in value]
    except (TypeError, ValueError):
        raise InvalidRequestError("malformed image data", "multi_modal_data") from None


@dataclasses.dataclass(frozen=True)
class MultiModalSpec:
    """What a vision-language model accepts. max_images: per prompt (vLLM's ``limit_mm_per_prompt``);
    max_image_tokens: the most tokens one image may take (the encoder's budget per step; the processor's pixel
    budget is lowered to fit it)."""

    processor: ImageProcessorConfig
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    max_images: int = 4
    max_image_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.max_images < 0 or self.max_image_tokens < 1:
            raise ValueError(f"bad multimodal limits: max_images {self.max_images}, "
                             f"max_image_tokens {self.max_image_tokens}")

    @property
    def merge(self) -> int:
        return self.processor.merge_size

    @property
    def patch_dim(self) -> int:
        p = self.processor
        return 3 * p.temporal_patch_size * p.patch_size ** 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> MultiModalSpec:
        p = dict(raw["processor"])
        p["image_mean"], p["image_std"] = tuple(p["image_mean"]), tuple(p["image_std"])
        return cls(**{**raw, "processor": ImageProcessorConfig(**p)})

    def prepare(self, ids: list[int], images: list) -> tuple[list[int], MultiModalInputs]:
        """A prompt with one image-pad token per image (as chat templates write it) and the images (Pillow) -> the
        prompt with each placeholder expanded to its image's tokens, and its inputs."""
        if len(images) > self.max_images:
            raise InvalidRequestError(f"{len(images)} images in one prompt; at most {self.max_images} are allowed",
                                      "multi_modal_data")
        placeholders = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(placeholders) != len(images):
            raise InvalidRequestError(f"the prompt has {len(placeholders)} image placeholders for {len(images)} "
                                      "images", "multi_modal_data")
        rows, grids = [], []
        for image in images:
            if not hasattr(image, "convert"):
                raise InvalidRequestError(f"an image must be a PIL.Image, got {type(image).__name__}",
                                          "multi_modal_data")
            try:
                r, g = preprocess(image, self.processor)
            except ValueError as e:
                raise InvalidRequestError(f"image: {e}", "multi_modal_data") from None
            rows.append(r)
            grids.append(g)
        out: list[int] = []
        last = 0
        for at, g in zip(placeholders, grids, strict=True):
            out += ids[last:at] + [self.image_token_id] * (g[0] * (g[1] // self.merge) * (g[2] // self.merge))
            last = at + 1
        out += ids[last:]
        return out, MultiModalInputs.build(out, rows, grids, self)
