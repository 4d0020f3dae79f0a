"""GPT-OSS beyond the parity tests (`test_hf_parity`, `test_family_engines`): MXFP4 checkpoints (decoded as
transformers decodes them, and loaded to the logits of the model with those weights), each of the family's
departures changing the output, and the configs it refuses."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm.dtypes import E2M1_VALUES
from jaxllm.loading import LoadError, load_model
from jaxllm.models.families.gpt_oss import mxfp4_dequantize
from tests.models.test_hf_parity import _hf_logits

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
PROMPTS = [[5, 900, 17, 33, 250, 4, 4, 61, 700, 12, 9], [44, 3, 1000, 8, 76, 19, 500]]  # longer than the window (6)


def _dense_logits(lm, sequences=PROMPTS):
    width = max(map(len, sequences))
    ids, mask = np.zeros((len(sequences), width), np.int32), np.zeros((len(sequences), width), np.int32)
    for i, s in enumerate(sequences):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    out = np.asarray(lm.model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)))
    return [out[i, :len(s)] for i, s in enumerate(sequences)]


def _mxfp4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [..., in] float -> (blocks [..., in / 32, 16] uint8, scales [..., in / 32] uint8): per 32 values the
    power of two that brings the largest to at most 6, each value the nearest E2M1 (the test's own encoder)."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    peak = np.maximum(np.abs(groups).max(-1), 1e-30)
    exponent = np.clip(np.ceil(np.log2(peak / 6.0)), -127, 127).astype(np.int32)
    scaled = groups / np.ldexp(1.0, exponent)[..., None]
    nibbles = np.abs(scaled[..., None] - E2M1_VALUES).argmin(-1).astype(np.uint8)  # [..., G, 32]
    # contiguous: safetensors' numpy writer stores an array's memory as it lies, whatever its strides
    return (np.ascontiguousarray(nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)),
            np.ascontiguousarray(exponent + 127, np.uint8))


def test_mxfp4_decodes_as_transformers_does():
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 4, 16), dtype=np.uint8)  # [experts, out, in / 32, 16]
    scales = rng.integers(118, 136, (3, 8, 4), dtype=np.uint8)
    want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    got = mxfp4_dequantize(blocks, scales)  # [experts, out, in]: transformers returns [experts, in, out]
    np.testing.assert_array_equal(got, want.numpy().transpose(0, 2, 1))
    with pytest.raises(ValueError, match="do not pair"):
        mxfp4_dequantize(blocks, scales[:, :, :3])


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_model_dir, tmp_path_factory):
    """The tiny GPT-OSS with its experts stored as MXFP4 pairs (as the released checkpoints), and the transformers
    model with those experts' decoded weights."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    source, hf_model = tiny_model_dir("gpt_oss")
    folder = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = {}
    for file in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(file))
    decoded = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4_quantize(np.swapaxes(tensors.pop(name), 1, 2))  # [E, out, in / 32, ...]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        decoded[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                   dtype=torch.float32)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["self_attn", "router"]}
    (folder / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        original = {n: p.clone() for n, p in hf_model.named_parameters()}
        for name, value in decoded.items():
            dict(hf_model.named_parameters())[name].copy_(value)
        want = _hf_logits(hf_model, PROMPTS)
        for name, value in original.items():  # the session's tiny model stays as it was for other tests
            dict(hf_model.named_parameters())[name].copy_(value)
    return folder, want, decoded


def test_an_mxfp4_checkpoint_loads_to_the_logits_of_its_decoded_weights(mxfp4_checkpoint):
    folder, want, decoded = mxfp4_checkpoint
    lm = load_model(folder, dtype="float32", attn_impl="reference")
    for got, expected in zip(_dense_logits(lm), want, strict=True):
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
    # the experts are the decoded values, not the float originals: every one is a power of two times an E2M1 value
    gate_up = np.asarray(lm.model.layers.layer.mlp.experts.gate_up_proj.weight[...])  # [layers, E, out, in]
    np.testing.assert_array_equal(gate_up[0], decoded["model.layers.0.mlp.experts.gate_up_proj"].numpy()
                                  .transpose(0, 2, 1))


def test_an_mxfp4_weight_without_its_scales_is_refused(mxfp4_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder, _, _ = mxfp4_checkpoint
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(LoadError, match="'model.layers.1.mlp.experts.down_proj' has no down_proj_scales"):
        load_model(tmp_path, dtype="float32")


def _edited(folder, tmp_path, **changes):
    config = json.loads((folder / "config.json").read_text())
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return tmp_path


def test_each_departure_changes_the_output(tiny_model_dir, tmp_path):
    """The clamp, the sinks and the windows each matter on the tiny model (its parity with transformers would
    not notice a feature that changed nothing)."""
    folder, _ = tiny_model_dir("gpt_oss")
    base = _dense_logits(load_model(folder, dtype="float32", attn_impl="reference"))

    def differs(lm):
        return max(np.abs(a - b).max() for a, b in zip(_dense_logits(lm), base, strict=True))

    assert differs(load_model(_edited(folder, tmp_path / "unclamped", swiglu_limit=1e6), dtype="float32",
                              attn_impl="reference")) > 1e-2
    assert differs(load_model(_edited(folder, tmp_path / "global", layer_types=["full_attention"] * 3),
                              dtype="float32", attn_impl="reference")) > 1e-2
    lm = load_model(folder, dtype="float32", attn_impl="reference")
    sinks = lm.model.layers.layer.self_attn.sinks
    sinks.set_value(jnp.full_like(sinks[...], -1e30))  # no sink: plain softmax
    assert differs(lm) > 1e-2


def test_other_quantization_methods_are_refused(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("gpt_oss")
    edited = _edited(folder, tmp_path, quantization_config={"quant_method": "fp8"})
    with pytest.raises(LoadError, match="quant_method 'fp8' is not supported for GPT-OSS"):
        load_model(edited, dtype="float32")
