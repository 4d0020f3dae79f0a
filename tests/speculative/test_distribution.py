"""At temperature 1, speculation samples from plain decoding's distribution: 10,000 requests with seeds of their
own on each side (so the two samples are independent), and a chi-square test on the first three tokens cannot
tell them apart. For prompt lookup, the tiny random model is steered by a logit bias towards two tokens that its
prompt repeats, so the lookup drafts at every step and the target keeps about half of its drafts: the third token
comes from a verification row whenever the second matched its draft. For a draft model (the target's int8 copy,
drafting its own greedy tokens), top-k 2 keeps each step's choice between two tokens, one of them the draft's
most of the time."""

import collections

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxllm import LLM, SamplingParams

OPTIONS = dict(dtype="float32", attn_impl="auto", max_num_seqs=64, max_num_batched_tokens=256, num_pages=512,
               max_model_len=256)
A, B = 300, 301
PROMPT = [A, B, A, A, B, B, A, B, B, A, A, B]
SAMPLES = 10_000


def joint(llm: LLM, seeds: range) -> collections.Counter:
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True, logit_bias={A: 12.0, B: 12.0})
              for s in seeds]
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
    return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)


def contingency(want: collections.Counter, got: collections.Counter) -> tuple[int, float]:
    """-> (the token sequences seen 20 times or more on both sides together, the chi-square test's p-value with the
    rarer sequences merged into one cell)."""
    cells = sorted(set(want) | set(got))
    common = [c for c in cells if want[c] + got[c] >= 20]
    table = np.array([[want[c] for c in common] + [sum(want[c] for c in cells if c not in common)],
                      [got[c] for c in common] + [sum(got[c] for c in cells if c not in common)]])
    table = table[:, table.sum(axis=0) > 0]
    return len(common), chi2_contingency(table).pvalue


@pytest.mark.slow
def test_first_tokens_are_distributed_as_without_speculation(tiny_folder, compile_cache_dir):
    plain = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS)
    spec = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **OPTIONS,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2,
                                   "disable_by_batch_size": None})
    want = joint(plain, range(SAMPLES))
    got = joint(spec, range(SAMPLES, 2 * SAMPLES))
    stats = spec.spec_decode_stats
    assert stats.num_drafts >= 0.95 * SAMPLES and 0.3 < stats.acceptance_rate < 0.7  # drafts kept and refused
    common, pvalue = contingency(want, got)
    assert common >= 8  # the 8 sequences of the two tokens at least
    assert pvalue > 0.01


@pytest.mark.slow
def test_a_draft_models_tokens_are_distributed_as_without_speculation(tiny_folder, compile_cache_dir):
    options = dict(OPTIONS, token_buckets=(64, 256))
    plain = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **options)
    spec = LLM(str(tiny_folder), compilation_cache_dir=compile_cache_dir, **options,
               speculative_config={"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 2,
                                   "disable_by_batch_size": None})

    def sample(llm, seeds):
        params = [SamplingParams(temperature=1.0, top_k=2, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * len(params), params, use_tqdm=False)
        return collections.Counter(tuple(o.outputs[0].token_ids) for o in outs)

    want, got = sample(plain, range(SAMPLES)), sample(spec, range(SAMPLES, 2 * SAMPLES))
    stats = spec.spec_decode_stats
    assert stats.num_drafts >= 0.95 * SAMPLES and 0.3 < stats.acceptance_rate < 0.95  # drafts kept and refused
    common, pvalue = contingency(want, got)
    assert common >= 4  # two choices a step: several sequences of three tokens
    assert pvalue > 0.01
