import pytest

from jaxllm import LLM

ENGINE_OPTIONS = dict(max_num_seqs=32, max_num_batched_tokens=128, num_pages=512, max_model_len=1024)


@pytest.fixture(scope="session")
def smollm2_llm(compile_cache_dir):
    """One engine on the embedded SmolLM2 for the whole session (float32, 8 buckets up to 128 tokens)."""
    return LLM(dtype="float32", attn_impl="reference", compilation_cache_dir=compile_cache_dir, **ENGINE_OPTIONS)
