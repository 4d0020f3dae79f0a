"""Bad Hugging Face folders fail with a message naming the file and the problem."""

import json
import shutil

import pytest

from jaxllm.loading import LoadError, load_model


@pytest.fixture
def copy_of(tiny_model_dir, tmp_path):
    def make(case="llama"):
        src, _ = tiny_model_dir(case)
        dst = tmp_path / case
        shutil.copytree(src, dst)
        return dst
    return make


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_path(tmp_path):
    with pytest.raises(LoadError, match=r"nowhere: no such file or folder"):
        load_model(tmp_path / "nowhere")


def test_folder_without_config(tmp_path):
    with pytest.raises(LoadError, match=r"not a Hugging Face checkpoint folder \(no config.json\)"):
        load_model(tmp_path)


def test_no_safetensors(copy_of):
    folder = copy_of()
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(LoadError, match=r"llama: no \*\.safetensors files"):
        load_model(folder)


def test_index_lists_missing_shard(copy_of):
    folder = copy_of()
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(LoadError, match=rf"model.safetensors.index.json: lists {shard.name}, which is missing"):
        load_model(folder)


def test_truncated_safetensors(copy_of):
    folder = copy_of()
    shard = sorted(folder.glob("*.safetensors"))[-1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match=rf"{shard.name}: not a valid safetensors file"):
        load_model(folder)


def test_shape_disagrees_with_config(copy_of):
    folder = copy_of()
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(LoadError, match=r"safetensors: tensor 'model.layers.0.mlp.(down|gate|up)_proj.weight' has "
                                        r"shape \(\d+, \d+\), but the config implies"):
        load_model(folder)


def test_unknown_architecture(copy_of):
    folder = copy_of()
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(LoadError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'; supported: "
                                        r"Gemma2ForCausalLM, Gemma3ForCausalLM, GptOssForCausalLM, LlamaForCausalLM, "
                                        r"MistralForCausalLM, "
                                        r"MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2MoeForCausalLM, "
                                        r"Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        load_model(folder)


def test_config_missing_field_and_bad_heads(copy_of):
    folder = copy_of()
    _edit_config(folder, num_key_value_heads=3)
    with pytest.raises(LoadError, match=r"must be a multiple of num_key_value_heads \(3\)"):
        load_model(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["hidden_size"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match=r"config.json: missing the field 'hidden_size'"):
        load_model(folder)


def test_missing_tensor(copy_of):
    folder = copy_of()
    _edit_config(folder, num_hidden_layers=3)
    with pytest.raises(LoadError, match=r"checkpoint is missing \d+ tensor\(s\) the config needs, e.g. \['layers.2"):
        load_model(folder)


def test_unsupported_rope_type(copy_of):
    folder = copy_of()
    _edit_config(folder, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0})
    with pytest.raises(LoadError, match=r"unsupported rope_scaling type 'dynamic'"):
        load_model(folder)
    _edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(LoadError, match=r"longrope needs short_factor and long_factor of one length"):
        load_model(folder)


def test_a_stacked_checkpoint_tensor_that_disagrees_with_the_config(copy_of):
    """Phi-3 keeps q/k/v in one tensor, split by the config's head counts as it loads: a config with other counts
    is refused with the tensor's name and shape, not loaded into the wrong rows."""
    folder = copy_of("phi3")
    _edit_config(folder, num_key_value_heads=1)
    with pytest.raises(LoadError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape \(128, 64\), "
                                        r"but the config implies \(64, 64\)"):
        load_model(folder)


def test_longrope_factors_must_cover_the_rotary_frequencies(copy_of):
    folder = copy_of("phi3")  # head_dim 16, half of it rotating: 4 frequencies
    _edit_config(folder, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 3,
                                          "long_factor": [2.0] * 3, "original_max_position_embeddings": 64,
                                          "partial_rotary_factor": 0.5})
    with pytest.raises(LoadError, match=r"longrope has 3 factors for 4 rotary frequencies"):
        load_model(folder)
