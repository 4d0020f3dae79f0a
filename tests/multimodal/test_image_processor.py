"""Qwen-VL preprocessing against transformers' image processor: grids and pixel rows for images of many sizes and
aspect ratios (each side below, near and above the pixel budget)."""

import numpy as np
import pytest

from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess, target_size

SIZES = [(32, 32), (100, 50), (640, 480), (17, 300), (1000, 20), (333, 777), (28, 28), (56, 112), (250, 251),
         (1920, 1080)]


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_preprocessing_equals_the_hf_image_processor(family):
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if family == "qwen3-vl":  # 16-pixel patches, mean and std 0.5 (Qwen3-VL's preprocessor_config.json)
        cfg = ImageProcessorConfig(patch_size=16, min_pixels=64 * 64, max_pixels=32 * 32 * 64,
                                   image_mean=(0.5,) * 3, image_std=(0.5,) * 3)
    else:
        cfg = ImageProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    hf = Qwen2VLImageProcessorPil(min_pixels=cfg.min_pixels, max_pixels=cfg.max_pixels, patch_size=cfg.patch_size,
                                  image_mean=list(cfg.image_mean), image_std=list(cfg.image_std))
    rng = np.random.default_rng(0)
    for w, h in SIZES:
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        rows, grid = preprocess(image, cfg)
        want = hf(images=[image], return_tensors="np")
        assert grid == tuple(int(v) for v in want["image_grid_thw"][0]), (w, h)
        np.testing.assert_allclose(rows, want["pixel_values"], atol=1e-6, rtol=0)


def test_config_from_both_layouts_and_bad_images():
    old = ImageProcessorConfig.from_hf({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14})
    new = ImageProcessorConfig.from_hf({"size": {"shortest_edge": 3136, "longest_edge": 12845056}})
    assert old == new and old.factor == 28
    with pytest.raises(ValueError, match="aspect ratio"):
        target_size(1, 500, old)
    with pytest.raises(ValueError, match="pixels"):
        target_size(0, 5, old)
