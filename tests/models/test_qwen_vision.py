"""Qwen2.5-VL's vision encoder against transformers': several images of different sizes in one batch (window and
full-attention blocks, the merger, the window order undone)."""

import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny_vision():
    import torch
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLConfig(vision_config=dict(depth=4, hidden_size=32, num_heads=4, intermediate_size=64,
                                                 out_hidden_size=48, fullatt_block_indexes=[1, 3])).vision_config
    torch.manual_seed(0)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return config, model


def test_vision_encoder_matches_transformers(tiny_vision):
    import jax.numpy as jnp
    import torch
    from PIL import Image

    from jaxllm.models.qwen_vision import QwenVisionEncoder, VisionConfig, load_vision_arrays, vision_layout
    from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess

    hf_config, hf = tiny_vision
    cfg = VisionConfig.from_hf(hf_config.to_dict())
    assert cfg.fullatt_block_indexes == (1, 3) and cfg.window_size == 112
    encoder = QwenVisionEncoder(cfg)
    load_vision_arrays(encoder, {k: v.numpy() for k, v in hf.state_dict().items()})
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for w, h in [(224, 224), (100, 50), (300, 170), (60, 400)]]
    done = [preprocess(i, ImageProcessorConfig(max_pixels=28 * 28 * 100)) for i in images]
    rows, grids = [r for r, _ in done], [g for _, g in done]
    x = np.concatenate(rows)
    for batch in ([0], [1, 2], [0, 1, 2, 3]):  # alone and together: images never see each other
        sub_rows = np.concatenate([rows[i] for i in batch])
        sub_grids = [grids[i] for i in batch]
        with torch.no_grad():
            want = hf(torch.tensor(sub_rows), grid_thw=torch.tensor(sub_grids)).pooler_output.numpy()
        got = np.asarray(encoder(jnp.asarray(sub_rows), vision_layout(sub_grids, cfg)))
        assert got.shape == (sum(t * h * w for t, h, w in sub_grids) // 4, 48)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert x.shape[1] == cfg.patch_dim
