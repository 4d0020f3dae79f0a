"""`kv_cache_dtype`: the KV cache stored in bfloat16 or float8 while the model computes in float32. The paged
path's logits stay close to those of a float32 cache; the engine allocates, sizes and runs such caches; the CPU
attention kernel (float32, float16 and bfloat16 caches) is refused for float8 ones rather than silently
replaced."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, ModelConfig
from jaxllm.engine.config import EngineConfig
from jaxllm.models.llama import LlamaForCausalLM
from tests.paged_driver import PagedRunner

pytestmark = pytest.mark.slow  # SmolLM2 engines per cache type

CFG = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16)


# (dtype, max |logit error| as a fraction of the logits' spread, share of positions whose argmax agrees)
@pytest.mark.parametrize(("dtype", "max_error", "agreement"), [
    (jnp.bfloat16, 0.05, 1.0), (jnp.float8_e4m3fn, 0.5, 0.8), (jnp.float8_e5m2, 0.8, 0.75)])
def test_narrow_caches_keep_logits_close(dtype, max_error, agreement):
    model = LlamaForCausalLM(CFG, attn_impl="reference", rngs=nnx.Rngs(0))
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, 40).tolist()
    reference = PagedRunner(model, num_pages=16, page_size=4).step({0: ids}, all_logits=True)[0]
    runner = PagedRunner(model, num_pages=16, page_size=4, kv_dtype=dtype)
    got = runner.step({0: ids}, all_logits=True)[0]
    assert runner.caches[0].dtype == dtype and np.any(np.asarray(runner.caches[0], np.float32))
    assert np.abs(got - reference).max() < max_error * reference.std()
    assert (got.argmax(-1) == reference.argmax(-1)).mean() >= agreement


def test_the_engine_runs_a_float8_cache(tiny_model_dir, compile_cache_dir):
    folder, _ = tiny_model_dir("qwen2_tp")
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="float8_e4m3fn", num_pages=32, max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=32, compilation_cache_dir=compile_cache_dir)
    assert llm.engine.runner.caches[0].dtype == jnp.float8_e4m3fn
    assert llm.engine.model.kernels.attention == "reference"  # auto: the CPU kernel reads no float8 caches
    out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(temperature=0, max_tokens=6,
                                                                             ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_the_cpu_attention_kernel_is_refused_for_a_narrow_cache():
    model = LlamaForCausalLM(CFG, attn_impl="cpu", rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="cpu attention kernel reads float32, float16 or bfloat16 caches"):
        LLM(model=model, kv_cache_dtype="float8_e5m2", num_pages=8, max_model_len=32, max_num_seqs=1,
            max_num_batched_tokens=16)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be auto or one of"):
        EngineConfig(kv_cache_dtype="int4")
