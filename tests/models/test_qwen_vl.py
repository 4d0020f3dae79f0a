"""Qwen2.5-VL (folders in both config layouts) and Qwen3-VL against transformers: logits of prompts with 0, 1 and 2
images of different sizes through the dense path; M-RoPE positions against transformers' own."""

import json

import numpy as np
import pytest

from tests.matrix import sampled

IMAGE, START, END = 1000, 1002, 1003
SIZES = [(112, 84), (60, 120)]


@pytest.fixture(scope="module", params=sampled(["qwen2.5-vl nested", "qwen2.5-vl flat", "qwen3-vl"],
                                                lambda f: f == "qwen3-vl"))
def tiny_vl(request, tmp_path_factory):
    from tests.tiny_models import build_tiny_qwen2_5_vl

    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny_vl"), flat_config=request.param.endswith("flat"),
                                 family="qwen3_vl" if request.param == "qwen3-vl" else "qwen2_5_vl")


def _prompt(grids):
    from jaxllm.models.qwen_vl import image_tokens

    ids = [5, 6, 7]
    for g in grids:
        ids += [START] + [IMAGE] * image_tokens(g, 2) + [END, 8, 9]
    return ids + [10, 11, 12]


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_logits_match_transformers(tiny_vl, num_images):
    import jax.numpy as jnp
    import torch
    from PIL import Image

    from jaxllm.kernels import choose_kernels
    from jaxllm.loading.qwen_vl import load_qwen_vl
    from jaxllm.models.qwen_vl import mrope_positions
    from jaxllm.multimodal.image_processor import ImageProcessorConfig, preprocess
    from jaxllm.sharding import make_mesh

    folder, hf = tiny_vl
    model = load_qwen_vl(folder, dtype=jnp.float32, kernels=choose_kernels("reference", "reference"),
                         mesh=make_mesh(1))
    rng = np.random.default_rng(num_images)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in SIZES[:num_images]]
    processor = ImageProcessorConfig.from_hf(json.loads((folder / "preprocessor_config.json").read_text()))
    done = [preprocess(i, processor) for i in images]
    grids = [g for _, g in done]
    ids = _prompt(grids)
    positions = mrope_positions(ids, grids, IMAGE, 2)
    kwargs = {}
    if images:
        rows = np.concatenate([r for r, _ in done])
        kwargs = dict(pixel_values=torch.tensor(rows), image_grid_thw=torch.tensor(grids))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in ids]]),
                 **kwargs)
        want_positions, _ = hf.model.get_rope_index(torch.tensor([ids]), torch.tensor([[int(t == IMAGE) for t in ids]]),
                                                    image_grid_thw=torch.tensor(grids) if grids else None)
    np.testing.assert_array_equal(positions, want_positions[:, 0].numpy())
    got = model(jnp.asarray([ids]), jnp.asarray(positions[:, None]),
                *((jnp.asarray(rows), model.visual.layout(grids)) if images else ()))
    np.testing.assert_allclose(np.asarray(got)[0], out.logits[0].numpy(), atol=1e-4, rtol=0)
