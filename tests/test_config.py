import pytest

from jaxllm.config import ConfigError, ModelConfig, RopeConfig

BASE = dict(architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def test_legacy_and_v5_rope_spellings_agree():
    legacy = ModelConfig.from_hf({**BASE, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    v5 = ModelConfig.from_hf({**BASE, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}})
    assert legacy.rope == v5.rope == RopeConfig(theta=5e5, rope_type="llama3", factor=8.0,
                                                original_max_position_embeddings=8192)


def test_family_defaults():
    qwen2 = ModelConfig.from_hf({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 32})
    assert qwen2.attention_bias and not qwen2.o_bias and qwen2.sliding_window is None
    mistral = ModelConfig.from_hf({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 32})
    assert mistral.sliding_window == 32
    qwen3 = ModelConfig.from_hf({**BASE, "architectures": ["Qwen3ForCausalLM"], "head_dim": 48})
    assert qwen3.qk_norm and qwen3.head_dim == 48 and not qwen3.attention_bias


def test_config_validates_itself():
    with pytest.raises(ConfigError, match="head_dim must be even"):
        ModelConfig.from_hf({**BASE, "head_dim": 15})
    with pytest.raises(ConfigError, match="needs original_max_position_embeddings"):
        RopeConfig(rope_type="yarn", factor=4.0)
    with pytest.raises(ConfigError, match="mlp_bias=True is not supported"):
        ModelConfig.from_hf({**BASE, "mlp_bias": True})
