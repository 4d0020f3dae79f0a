"""SamplingParams(prompt_logprobs=k): every prompt token's log probability given those before it, its rank and the
k likeliest tokens at its position, as transformers computes them, whatever the chunking (prompts longer than a
step's token budget) and whatever else shares the steps; a cached prefix is not reused for them (every token is
scored), and the generated tokens are the same as without."""

import numpy as np
import pytest
import torch

from jaxllm import LLM, SamplingParams
from jaxllm.errors import InvalidRequestError
from tests.tiny_models import TOKENIZER_CORPUS

OPTIONS = dict(dtype="float32", attn_impl="reference", max_num_seqs=8, max_num_batched_tokens=64, num_pages=256,
               max_model_len=512)


@pytest.fixture(scope="module")
def setup(tiny_folder, compile_cache_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)
    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    return llm, hf


def reference(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, -1).numpy()  # [len, V]: row i predicts token i + 1


def test_prompt_logprobs_match_transformers(setup):
    llm, hf = setup
    text = " ".join(TOKENIZER_CORPUS * 2)  # longer than the 64-token budget: three or more chunks
    other = TOKENIZER_CORPUS[1]
    outs = llm.generate([text, {"prompt": other}], [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=3),
                                                      SamplingParams(temperature=0, max_tokens=4)], use_tqdm=False)
    out = outs[0]
    ids = out.prompt_token_ids
    assert len(ids) > 2 * OPTIONS["max_num_batched_tokens"]
    assert outs[1].prompt_logprobs is None
    plp = out.prompt_logprobs
    assert len(plp) == len(ids) and plp[0] is None
    want = reference(hf, ids)
    for i in range(1, len(ids)):
        row = want[i - 1]
        entry = plp[i]
        assert ids[i] in entry and len(entry) in (3, 4)
        assert entry[ids[i]].logprob == pytest.approx(row[ids[i]], abs=2e-4)
        lp = row[ids[i]]  # its rank: 1 + the tokens likelier (near-ties either way)
        assert 1 + np.sum(row > lp + 1e-4) <= entry[ids[i]].rank <= 1 + np.sum(row > lp - 1e-4)
        top = sorted((e for e in entry.values() if e.rank <= 3), key=lambda e: e.rank)
        assert [e.rank for e in top] == [1, 2, 3]
        np.testing.assert_allclose([e.logprob for e in top], np.sort(row)[::-1][:3], atol=2e-4)
        assert entry[ids[i]].decoded_token == llm.get_tokenizer().decode([ids[i]], skip_special_tokens=False)
    # the generated tokens are the ones without prompt logprobs
    plain = llm.generate(text, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_a_cached_prefix_is_scored_again(setup):
    llm, hf = setup
    text = TOKENIZER_CORPUS[2] * 4
    llm.generate(text, SamplingParams(max_tokens=1), use_tqdm=False)  # its pages are now in the prefix cache
    hits = llm.engine.block_manager.prefix_hits
    out = llm.generate(text, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and llm.engine.block_manager.prefix_hits == hits
    assert all(len(e) == 1 for e in out.prompt_logprobs[1:])  # k = 0: the prompt token alone
    want = reference(hf, out.prompt_token_ids)
    got = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:], strict=True)]
    np.testing.assert_allclose(got, [want[i - 1][t] for i, t in enumerate(out.prompt_token_ids) if i], atol=2e-4)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_values_are_refused(bad):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)
