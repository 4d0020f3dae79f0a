"""The families that differ most from Llama's decoder, through the engine: greedy tokens equal transformers'
`generate` on prompts longer than their sliding windows (prefix caching and chunked prefill on, the numba CPU
attention kernel), the same tokens alone and in a batch, and nothing compiled after warm-up. Phi-3: fused
checkpoint tensors and partial RoPE; Gemma 2: soft caps, sandwich norms, alternating windows; Gemma 3: q/k norms and
a RoPE per kind of layer; GPT-OSS: attention sinks, biased router and experts, a clamped SwiGLU."""

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import compile_monitor
from tests.matrix import sampled

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module", params=sampled(["phi3", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral",
                                                 "gpt_oss"], lambda f: f in ("gemma2", "qwen3_moe", "gpt_oss")))
def family(request, tiny_model_dir, compile_cache_dir):
    folder, hf_model = tiny_model_dir(request.param)
    llm = LLM(str(folder), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, num_pages=96,
              max_model_len=64, page_size=4, enable_prefix_caching=True, compilation_cache_dir=compile_cache_dir)
    return llm, hf_model


def _hf_greedy(hf_model, prompt, n):
    import torch

    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_greedy_equals_transformers_alone_and_in_a_batch(family):
    llm, hf_model = family
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 1024, n).tolist() for n in (9, 23, 17)]  # windows of 6: every prompt is longer
    prompts.append(prompts[1][:12] + rng.integers(3, 1024, 5).tolist())  # shares a cached prefix with prompt 1
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [_hf_greedy(hf_model, p, 10) for p in prompts]
    before = compile_monitor.snapshot()
    batch = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert batch == want
    assert alone == batch
    assert compile_monitor.snapshot() == before
    assert llm.engine.block_manager.num_free_pages == llm.engine.block_manager.num_pages
