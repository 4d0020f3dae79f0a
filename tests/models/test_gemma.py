"""Gemma 2 and 3: each of their departures from Llama's decoder changes the tiny test models' logits (so the parity
tests in test_hf_parity.py check every one of them), and their config.json spellings read as transformers reads
them."""

import json
import shutil

import numpy as np
import pytest

from jaxllm.config import ConfigError, ModelConfig
from jaxllm.loading import load_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
IDS = np.random.default_rng(5).integers(0, 1024, (1, 20)).astype(np.int32)  # longer than the windows of 6


def _logits(folder) -> np.ndarray:
    return np.asarray(load_model(folder, dtype="float32", attn_impl="reference").model(IDS))


@pytest.mark.parametrize(("case", "change"), [
    ("gemma2", {"attn_logit_softcapping": None}),
    ("gemma2", {"final_logit_softcapping": None}),
    ("gemma2", {"query_pre_attn_scalar": 16}),  # head_dim's own scale
    ("gemma2", {"sliding_window": 64}),  # no token outside the window
    ("gemma3", {"layer_types": ["full_attention"] * 3}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}}),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 100000.0}}}),
])
def test_each_peculiarity_changes_the_logits(case, change, tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir(case)
    changed = tmp_path / case
    shutil.copytree(folder, changed)
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, **change}))
    assert np.abs(_logits(folder) - _logits(changed)).max() > 1e-2


def _gemma3(**extra) -> dict:
    return {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, **extra}


def test_gemma3_reads_the_earlier_config_spelling():
    cfg = ModelConfig.from_hf(_gemma3(rope_theta=1e6, rope_local_base_freq=5e3, sliding_window=8,
                                      rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert cfg.layer_windows == (8, 8, 8, 8, 8, 0, 8)  # the sixth layer of every six is global
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (1e6, "linear", 8.0)
    assert (cfg.local_rope.theta, cfg.local_rope.rope_type) == (5e3, "default")
    assert cfg.attn_scale == 256 ** -0.5 and cfg.attn_soft_cap is None and cfg.final_soft_cap is None
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.embed_scale and cfg.rms_norm_offset == 1.0
    assert cfg.tie_word_embeddings and cfg.activation == "gelu_tanh"


def test_gemma2_defaults_are_transformers():
    cfg = ModelConfig.from_hf({**_gemma3(num_hidden_layers=4), "architectures": ["Gemma2ForCausalLM"]})
    assert cfg.layer_windows == (4096, 0, 4096, 0)
    assert (cfg.attn_soft_cap, cfg.final_soft_cap, cfg.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    assert cfg.local_rope is None and not cfg.qk_norm


@pytest.mark.parametrize(("extra", "message"), [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 7}, "layer_types"),
    ({"sliding_window": None}, "sliding_window"),
])
def test_bad_gemma_configs_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf(_gemma3(**extra))
