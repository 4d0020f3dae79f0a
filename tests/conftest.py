"""Shared fixtures. Four host devices are requested before JAX initialises so sharding tests can run;
every other test uses the first device only."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

from tests.tiny_models import build_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """case name -> folder with a tiny random HF model (config.json + safetensors)."""
    root = tmp_path_factory.mktemp("tiny_models")
    cache: dict[str, object] = {}

    def get(case: str):
        if case not in cache:
            cache[case] = build_tiny_hf_model(case, root / case)
        return cache[case]

    return get


@pytest.fixture(scope="session")
def smollm2_path():
    from jaxllm.loading.embedded import embedded_model_path

    return embedded_model_path()



@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """One JAX persistent compilation cache for the session: engines with equal shapes compile once."""
    return str(tmp_path_factory.mktemp("xla_cache"))
