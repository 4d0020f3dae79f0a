"""Qwen-VL image preprocessing without torch: resize to the model's pixel budget keeping the aspect ratio (sides
multiples of patch x merge), scale to [0, 1], normalize per channel, and cut into the flat patch rows the vision
encoder's patch embedding reads, merge window by merge window, as the HF image processor lays them out.

One image gives ``grid = (1, h, w)`` patches of ``patch_size`` pixels and ``h * w`` rows of
``channels * temporal_patch_size * patch_size**2`` values (a still image is repeated along the temporal axis);
the language model sees ``h * w / merge_size**2`` image tokens for it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


@dataclasses.dataclass(frozen=True)
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels}, {self.max_pixels}")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ImageProcessorConfig:
        """From a ``preprocessor_config.json`` (``min_pixels`` / ``max_pixels``, or transformers 5's ``size``
        with ``shortest_edge`` / ``longest_edge`` in pixels)."""
        size = raw.get("size") or {}
        kwargs = {k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size") if k in raw}
        kwargs["min_pixels"] = int(raw.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels)
        kwargs["max_pixels"] = int(raw.get("max_pixels") or size.get("longest_edge") or cls.max_pixels)
        for name in ("image_mean", "image_std"):
            if raw.get(name) is not None:
                kwargs[name] = tuple(float(v) for v in raw[name])
        return cls(**kwargs)


def target_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): each side a multiple of patch x merge, nearest to the original, then scaled
    (same aspect ratio) into [min_pixels, max_pixels]."""
    if min(height, width) < 1:
        raise ValueError(f"an image of {width} x {height} pixels")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"an aspect ratio over {MAX_ASPECT_RATIO} ({width} x {height})")
    f = cfg.factor
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > cfg.max_pixels:
        shrink = math.sqrt(height * width / cfg.max_pixels)
        h = max(f, math.floor(height / shrink / f) * f)
        w = max(f, math.floor(width / shrink / f) * f)
    elif h * w < cfg.min_pixels:
        grow = math.sqrt(cfg.min_pixels / (height * width))
        h, w = math.ceil(height * grow / f) * f, math.ceil(width * grow / f) * f
    return h, w


def preprocess(image, cfg: ImageProcessorConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """A Pillow image -> (patch rows [h * w, 3 * T * P * P] float32, grid (1, h, w))."""
    from PIL import Image

    rgb = image.convert("RGB")
    height, width = target_size(rgb.height, rgb.width, cfg)
    resized = np.asarray(rgb.resize((width, height), Image.Resampling.BICUBIC), np.float32)  # [H, W, 3]
    mean, std = np.asarray(cfg.image_mean, np.float32), np.asarray(cfg.image_std, np.float32)
    pixels = ((resized * np.float32(1 / 255) - mean) / std).transpose(2, 0, 1)  # [3, H, W]
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    # [3, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, 3, p, p]: rows go merge window by merge window
    blocks = pixels.reshape(3, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    rows = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # a still image: T copies
    return np.ascontiguousarray(rows.reshape(gh * gw, 3 * t * p * p)), (1, gh, gw)
