"""Phi-3's LongRoPE (the 128k variants): the short factors for a model whose context stays within the original
length, the long ones beyond it (`set_context_length`, which the engine calls with its max_model_len), each equal to
transformers' logits where transformers runs the same set (it picks by each forward's length), and an engine whose
context exceeds the original length generating transformers' greedy tokens on prompts past it."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.loading import load_model
from tests.models.test_family_engines import _hf_greedy
from tests.models.test_hf_parity import _hf_logits

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
ORIGINAL = 32  # the tiny model's original_max_position_embeddings


def test_short_and_long_factors_match_transformers(tiny_model_dir):
    folder, hf_model = tiny_model_dir("phi3_longrope")
    lm = load_model(folder, dtype="float32", attn_impl="reference")
    rope = lm.config.rope
    assert rope.rope_type == "longrope" and rope.factor == 8.0 and not rope.long_context
    rng = np.random.default_rng(0)
    short, long = (rng.integers(3, 1024, n).tolist() for n in (20, 40))
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray([short])))[0], _hf_logits(hf_model, [short])[0],
                               atol=1e-4, rtol=0)
    want_long = _hf_logits(hf_model, [long])[0]
    assert np.abs(np.asarray(lm.model(jnp.asarray([long])))[0] - want_long).max() > 1e-3  # short factors: not it
    lm.model.set_context_length(256)
    assert lm.model.config.rope.long_context
    np.testing.assert_allclose(np.asarray(lm.model(jnp.asarray([long])))[0], want_long, atol=1e-4, rtol=0)


def test_an_engine_past_the_original_length_runs_the_long_factors(tiny_model_dir, compile_cache_dir):
    folder, hf_model = tiny_model_dir("phi3_longrope")
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, num_pages=64,
              max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)
    assert llm.engine.model.config.rope.long_context
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (ORIGINAL + 1, ORIGINAL + 9)]  # every forward past 32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)]
    assert got == [_hf_greedy(hf_model, p, 8) for p in prompts]
