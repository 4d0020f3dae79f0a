"""EngineConfig: its compiled step shapes, presets and checks."""

import pytest

from jaxllm.engine.config import EngineConfig


def test_default_buckets_are_powers_of_two_up_to_the_budget():
    assert EngineConfig(max_num_batched_tokens=100, max_num_seqs=64).buckets() == [
        (1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 32), (64, 64), (100, 64)]


def test_a_smaller_budget_over_a_presets_buckets_drops_those_it_never_fills():
    preset = EngineConfig.from_preset("smollm2-cpu")
    tokens = [t for t, _ in preset.buckets()]
    assert tokens[-1] == preset.max_num_batched_tokens and 160 in tokens  # between the powers of two
    small = EngineConfig.from_preset("smollm2-cpu", max_num_batched_tokens=100, max_num_seqs=16)
    assert small.buckets() == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 16), (48, 16), (64, 16), (96, 16),
                               (128, 16)]


def test_the_embedded_model_starts_from_one_preset_everywhere():
    """`LLM()`, `jaxllm serve` / gunicorn and `jaxllm generate` run the embedded model with the same engine config
    (generate sizes its KV cache for its own sequences: only num_pages differs)."""
    import dataclasses

    from jaxllm import LLM
    from jaxllm.generate import _engine_config, parse_args
    from server.settings import ServerSettings

    offline = LLM.engine_config()
    server = ServerSettings.from_env({}).engine
    assert offline == server
    assert offline == EngineConfig.from_preset("smollm2-cpu")
    cli = _engine_config(parse_args(["hello"]), num_sequences=1)
    assert dataclasses.replace(cli, num_pages=None) == offline
    # another model: its platform's preset, the same from every entry point
    folder = LLM.engine_config("some/folder")
    assert folder == EngineConfig.from_preset("cpu", model="some/folder")
    assert folder == ServerSettings.from_env({"JAXLLM_MODEL": "some/folder"}).engine
    cli = _engine_config(parse_args(["--model", "some/folder", "hi"]), 1)
    assert dataclasses.replace(cli, num_pages=None) == folder
    assert LLM.engine_config("some/folder", preset="smollm2-cpu").max_model_len == 8192  # a named preset wins
    assert folder.kv_cache_dtype == "auto" and folder.dtype == "float32"


def test_each_platform_has_a_preset():
    from jaxllm.engine.config import default_preset

    assert default_preset(None) == "smollm2-cpu"
    assert [default_preset("m", p) for p in ("cpu", "gpu", "cuda", "tpu")] == ["cpu", "gpu", "gpu", "tpu"]
    for name in ("cpu", "gpu", "tpu"):
        config = EngineConfig.from_preset(name)
        assert config.model is None and config.buckets()


def test_lora_dtype_is_checked_and_auto_follows_the_weights():
    import jax.numpy as jnp

    from jaxllm.config import ConfigError
    from jaxllm.models.lora import table_dtype

    with pytest.raises(ConfigError, match="lora_dtype must be auto or one of float32, bfloat16, float16"):
        EngineConfig(model="m", lora_dtype="int8")
    assert EngineConfig(model="m", lora_dtype="float16").lora_dtype == "float16"
    assert table_dtype("auto", jnp.float32, quantized=False) == jnp.float32  # float weights: the model's dtype
    assert table_dtype("auto", jnp.float32, quantized=True) == jnp.bfloat16
    assert table_dtype("float32", jnp.float32, quantized=True) == jnp.float32
