"""The engine on the real SmolLM2: parity with transformers, batch invariance, prefix caching, aborts,
no recompilation after warm-up."""

import _queue
import random
import time

import numpy as np
import pytest

from jaxllm import SamplingParams
from jaxllm.engine import compile_monitor
from jaxllm.engine.engine_loop import EngineLoop
from tests.conftest import ENGINE_OPTIONS

ENGINE_OPTIONS_DEFAULT = {**ENGINE_OPTIONS, "attn_impl": "auto"}

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.", "What is 12 times 7?", "Give me a tip for better sleep.",
    "Who wrote Romeo and Juliet?", "Translate 'good morning' to Spanish.", "What is a prime number?",
    "Describe the ocean in five words.", "Why is the sky blue?", "List two uses of a paperclip.",
    "What does a compiler do?", "Suggest a name for a cat.", "How many legs does a spider have?",
    "What is the boiling point of water?",
]


def chat_ids(llm, question):
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": question}], tokenize=True)


@pytest.fixture(scope="module")
def transformers_greedy(smollm2_llm, smollm2_path):
    """The 16 chat prompts and transformers' 64 greedy tokens for each (computed once for both kernel choices)."""
    import torch
    import transformers

    prompts = [chat_ids(smollm2_llm, q) for q in QUESTIONS]
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)
        refs.append(ref[0, len(prompt):].tolist())
    return prompts, refs


@pytest.mark.slow
def test_16_greedy_prompts_in_one_call_match_transformers(any_smollm2_llm, transformers_greedy):
    prompts, refs = transformers_greedy
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = any_smollm2_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for ref, out in zip(refs, outs, strict=True):
        assert out.outputs[0].token_ids == ref, out.outputs[0].text
        assert out.outputs[0].finish_reason == "length"


def _stream(loop, request_id, prompt, params):
    q = _queue.SimpleQueue()
    loop.add_request(request_id, prompt, params, q.put)
    return q


def _final(q, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        out = q.get(timeout=max(0.1, deadline - time.monotonic()))
        assert not isinstance(out, Exception), out
        if out.finished:
            return out


def test_batch_invariance_greedy_and_seeded(any_smollm2_llm):
    smollm2_llm = any_smollm2_llm
    target = chat_ids(smollm2_llm, "Tell me a short story about a robot learning to paint.")
    greedy = SamplingParams(temperature=0, max_tokens=40)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=40, seed=1234)
    alone = [smollm2_llm.generate({"prompt_token_ids": target}, p, use_tqdm=False)[0].outputs[0].token_ids
             for p in (greedy, seeded)]
    loop = EngineLoop(smollm2_llm.engine)
    try:
        rng = random.Random(0)
        others = []
        for i in range(31):  # 31 other requests, arriving while the target runs
            q = chat_ids(smollm2_llm, QUESTIONS[i % len(QUESTIONS)] + " " * (i % 3))
            others.append(_stream(loop, f"other-{i}", q, SamplingParams(
                temperature=rng.choice([0, 0.7, 1.0]), max_tokens=rng.randint(5, 50), seed=i)))
            if i == 10:
                tg = _stream(loop, "target-greedy", target, greedy)
            if i == 20:
                ts = _stream(loop, "target-seeded", target, seeded)
            time.sleep(rng.uniform(0, 0.05))
        together = [_final(tg).outputs[0].token_ids, _final(ts).outputs[0].token_ids]
        for q in others:
            _final(q)
    finally:
        loop.stop()
    assert together == alone
    assert alone[0] != alone[1]


def test_prefix_cache_hit_counts(any_smollm2_llm):
    smollm2_llm = any_smollm2_llm
    engine = smollm2_llm.engine
    system = [{"role": "system", "content": "You are a meticulous assistant. " * 16}]
    tok = smollm2_llm.get_tokenizer()
    first = tok.apply_chat_template(system + [{"role": "user", "content": "Hi"}], tokenize=True)
    second = tok.apply_chat_template(system + [{"role": "user", "content": "Hello there, friend"}], tokenize=True)
    common = next(i for i, (a, b) in enumerate(zip(first, second, strict=False)) if a != b)
    params = SamplingParams(temperature=0, max_tokens=2)
    smollm2_llm.generate({"prompt_token_ids": first}, params, use_tqdm=False)
    out = smollm2_llm.generate({"prompt_token_ids": second}, params, use_tqdm=False)[0]
    page = engine.config.page_size
    assert out.num_cached_tokens == common // page * page > 64


def test_prompts_admitted_together_share_the_pages_they_fill(any_smollm2_llm):
    """Two requests with one system prompt in the same step: the second reads the pages the first writes in that
    step (its K/V lands before any query attends) and its tokens are the ones it gets alone; another tenant's
    copy shares nothing."""
    llm = any_smollm2_llm
    tok = llm.get_tokenizer()
    system = [{"role": "system", "content": "Answer like a patient tutor of chemistry. " * 4}]
    prompts = [tok.apply_chat_template(system + [{"role": "user", "content": q}], tokenize=True)
               for q in ("What is an atom?", "What is a molecule?")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert llm.reset_prefix_cache()
    alone = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in prompts]
    assert llm.reset_prefix_cache()
    together = llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]},
                             {"prompt_token_ids": prompts[1], "cache_salt": "another-tenant"}], params,
                            use_tqdm=False)
    page = llm.engine.config.page_size
    common = next(i for i, (a, b) in enumerate(zip(*prompts, strict=False)) if a != b)
    shared = common // page * page
    assert shared >= 2 * page and len(prompts[0]) + len(prompts[1]) - shared <= ENGINE_OPTIONS[
        "max_num_batched_tokens"]  # the first two fit one step
    assert [o.num_cached_tokens for o in together] == [0, shared, 0]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone + alone[1:]]


def test_abort_frees_pages(smollm2_llm):
    engine = smollm2_llm.engine
    free_before = engine.block_manager.num_free_pages
    engine.add_request("to-abort", chat_ids(smollm2_llm, "Count to one hundred."),
                       SamplingParams(max_tokens=500, n=2))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_free_pages < free_before
    engine.abort_request("to-abort")
    assert engine.block_manager.num_free_pages == free_before
    assert not engine.has_unfinished_requests()


def test_cache_salt_keeps_prefix_pages_apart(smollm2_llm):
    """Requests with different cache_salt values never share cached pages; the same salt does."""
    system = [{"role": "system", "content": "You are a careful assistant for tenant data. " * 12}]
    tok = smollm2_llm.get_tokenizer()
    prompt = tok.apply_chat_template(system + [{"role": "user", "content": "Hi"}], tokenize=True)
    params = SamplingParams(temperature=0, max_tokens=2)

    def cached(salt):
        return smollm2_llm.generate({"prompt_token_ids": prompt, "cache_salt": salt}, params,
                                    use_tqdm=False)[0].num_cached_tokens

    assert cached("tenant-a") == 0  # first time for this salt
    assert cached("tenant-a") > 64  # same salt: hit
    assert cached("tenant-b") == 0  # another tenant sees nothing of tenant-a's pages
    assert cached(None) == 0 and cached(None) > 64


def test_preemption_keeps_greedy_outputs(compile_cache_dir, smollm2_llm_default_kernels):
    """With too few pages for the batch, sequences are preempted and recomputed; their greedy tokens are those
    of the roomy engine (default kernels)."""
    from jaxllm import LLM

    prompts = [{"prompt_token_ids": chat_ids(smollm2_llm_default_kernels, q)} for q in QUESTIONS[:8]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in smollm2_llm_default_kernels.generate(prompts, params, use_tqdm=False)]
    tight = LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS_DEFAULT, "num_pages": 24})
    outs = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert outs == roomy
    bm = tight.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_no_recompilation_after_warmup(smollm2_llm):
    before = compile_monitor.snapshot()
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(40):
        q = QUESTIONS[i % len(QUESTIONS)] * rng.randint(1, 12)  # prompts from ~10 to ~200 tokens: chunked
        prompts.append({"prompt_token_ids": chat_ids(smollm2_llm, q)})
        params.append(SamplingParams(
            n=rng.choice([1, 1, 2]), temperature=rng.choice([0, 0.8]), top_k=rng.choice([0, 20]),
            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]), presence_penalty=rng.choice([0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]), logit_bias=rng.choice([None, {11: 2.0}]),
            logprobs=rng.choice([None, 3]), stop=rng.choice([(), ("\n",)]), min_tokens=rng.choice([0, 3]),
            max_tokens=rng.randint(3, 30), seed=i))
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    assert all(o.finished for o in outs)
    after = compile_monitor.snapshot()
    assert after == before, (before, after)
    assert smollm2_llm.engine.block_manager.num_free_pages == smollm2_llm.engine.block_manager.num_pages


def test_sampling_outputs_are_well_formed(smollm2_llm):
    out = smollm2_llm.chat([{"role": "user", "content": "Write a list of fruits, one per line."}],
                           SamplingParams(temperature=0.8, n=2, max_tokens=30, logprobs=2, stop=["\n"],
                                          seed=5), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for c in out.outputs:
        assert "\n" not in c.text
        assert len(c.logprobs) == len(c.token_ids)
        assert all(c.token_ids[i] in c.logprobs[i] and len(c.logprobs[i]) <= 3 for i in range(len(c.token_ids)))
        np.testing.assert_allclose(c.cumulative_logprob,
                                   sum(c.logprobs[i][t].logprob for i, t in enumerate(c.token_ids)), rtol=1e-4)
        assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("bad", [dict(prompt=[]), dict(prompt=[10**9]), dict(prompt=list(range(1, 1100)))])
def test_bad_prompts_are_rejected(smollm2_llm, bad):
    with pytest.raises(ValueError):
        smollm2_llm.engine.add_request("bad", bad["prompt"], SamplingParams())
    assert not smollm2_llm.engine.has_unfinished_requests()
