"""Speculative decoding in the engine, on the embedded SmolLM2 as it ships (Q4_1 layers, the CPU kernels): the
output is plain decoding's token for token, greedy or seeded at any temperature (every position's sample is
drawn with the key of its token index, from logits that do not depend on how many rows the step has), with
drafts accepted and rejected on the way; nothing compiles after warm-up; every page is free after aborts and
preemptions; sequences that may not draft decode beside those that do."""

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.engine import compile_monitor
from tests.conftest import ENGINE_OPTIONS

pytestmark = pytest.mark.slow  # SmolLM2 engines with and without drafts

OPTIONS = {**ENGINE_OPTIONS, "attn_impl": "auto", "quantization": "auto"}  # as smollm2_quantized_llm
# drafts whatever the batch (the "auto" limit reads this host's step times: tests/speculative/test_batch_limit.py)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "disable_by_batch_size": None}
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n")
GROUNDED = [
    [{"role": "user", "content": "Rename width to w and height to h in this code, and show all of it:\n" + CODE}],
    [{"role": "user", "content": "Repeat this sentence three times: The river carries the boats to the sea."}],
]
OPEN = [[{"role": "user", "content": "Write a short poem about the night."}]]


@pytest.fixture(scope="module")
def spec_llm(compile_cache_dir):
    return LLM(compilation_cache_dir=compile_cache_dir, speculative_config=SPEC, **OPTIONS)


def _chat(llm, params):
    return [(c.token_ids, c.text, c.finish_reason, c.cumulative_logprob,
             None if c.logprobs is None else [{t: (lp.logprob, lp.rank) for t, lp in d.items()} for d in c.logprobs])
            for out in llm.chat(GROUNDED + OPEN, params, use_tqdm=False) for c in out.outputs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=96),
    SamplingParams(temperature=1.0, seed=3, max_tokens=96, logprobs=2),
    SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=11, max_tokens=96, n=2, stop=["perimeter"]),
], ids=["greedy", "seeded", "filtered-n2-stop"])
def test_outputs_are_plain_decodings_token_for_token(spec_llm, smollm2_quantized_llm, params):
    before = spec_llm.spec_decode_stats.num_draft_tokens, spec_llm.spec_decode_stats.num_accepted_tokens
    got = _chat(spec_llm, params)
    assert got == _chat(smollm2_quantized_llm, params)
    stats = spec_llm.spec_decode_stats
    drafted, kept = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert kept > 0 and drafted > kept  # drafts were kept and rejected on the way


def test_guessed_steps_hold_or_are_dropped_and_change_no_token(spec_llm, smollm2_quantized_llm):
    """Async scheduling dispatches a drafted step's successor on a guess that every draft is kept
    (`LLMEngine._guess_ahead`): on prompts that quote, guesses hold and some fail (a draft rejected, another token
    sampled), the outputs stay plain decoding's, and every page is free after."""
    stats = spec_llm.spec_decode_stats
    before = stats.num_guessed_steps, stats.num_guessed_steps_held
    params = SamplingParams(temperature=0, max_tokens=96)
    got = [o.outputs[0].token_ids for o in spec_llm.chat(GROUNDED * 2, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in smollm2_quantized_llm.chat(GROUNDED * 2, params, use_tqdm=False)]
    for conv in GROUNDED:  # one at a time: a step of one sequence is guessed on whenever it drafts
        got = spec_llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids
        assert got == smollm2_quantized_llm.chat([conv], params, use_tqdm=False)[0].outputs[0].token_ids
    guessed, held = stats.num_guessed_steps - before[0], stats.num_guessed_steps_held - before[1]
    assert guessed > held > 0
    bm = spec_llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_no_compiles_after_warmup_and_every_page_free_after_aborts(spec_llm):
    prompt = spec_llm.get_tokenizer().apply_chat_template(GROUNDED[0], add_generation_prompt=True)
    run_with_aborts(spec_llm.engine, [prompt] * 6, SamplingParams(temperature=0, max_tokens=64), steps=8)


def assert_plain_outputs(spec, plain, prompts, params) -> None:
    """`spec` (an LLM with speculation) generates `plain`'s outputs: the same tokens, and cumulative logprobs to 6
    digits (a sampled token's logprob may differ in its last bit between steps of other compositions: drafts change
    which rows share a step, speculation or not); and it kept drafts and refused some on the way."""
    def outputs(llm):
        return [[(c.token_ids, None if c.cumulative_logprob is None else float(f"{c.cumulative_logprob:.6g}"))
                 for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]

    stats = spec.spec_decode_stats
    before = stats.num_draft_tokens, stats.num_accepted_tokens
    assert outputs(spec) == outputs(plain)
    drafted, kept = stats.num_draft_tokens - before[0], stats.num_accepted_tokens - before[1]
    assert kept > 0 and drafted > kept


def run_with_aborts(engine, prompts, params, steps: int) -> None:
    """Runs `prompts`, aborting the second and the fifth after `steps` steps: nothing compiles, and every page is
    free at the end."""
    before = compile_monitor.snapshot()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"a{i}", prompt, params)
    for _ in range(steps):
        engine.step()
    engine.abort_request("a1")
    engine.abort_request("a4")
    while engine.has_unfinished_requests():
        engine.step()
    assert compile_monitor.snapshot() == before
    assert engine.block_manager.num_free_pages == engine.block_manager.num_pages


def test_preempted_speculating_sequences_end_as_plain_ones(compile_cache_dir, smollm2_quantized_llm):
    """Few pages: sequences are preempted and recomputed while they speculate; outputs unchanged, pages all free."""
    small = LLM(compilation_cache_dir=compile_cache_dir, speculative_config=SPEC, **{**OPTIONS, "num_pages": 40})
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    prompts = GROUNDED * 3
    got = [o.outputs[0].token_ids for o in small.chat(prompts, params, use_tqdm=False)]
    assert small.engine.scheduler.num_preemptions > 0 and small.spec_decode_stats.num_accepted_tokens > 0
    want = [o.outputs[0].token_ids for o in smollm2_quantized_llm.chat(prompts, params, use_tqdm=False)]
    assert got == want
    bm = small.engine.block_manager
    assert bm.num_free_pages == bm.num_pages


def test_sequences_that_may_not_draft_decode_beside_those_that_do(spec_llm, smollm2_quantized_llm):
    """Penalties, min_tokens and a grammar keep a sequence to one token a step (their samples depend on the
    tokens before them); in a batch with drafting sequences they get plain decoding's tokens."""
    batch = [SamplingParams(temperature=0, max_tokens=48),
             SamplingParams(temperature=0, max_tokens=48, repetition_penalty=1.3, presence_penalty=0.5),
             SamplingParams(temperature=0, max_tokens=48, min_tokens=40, ignore_eos=False),
             SamplingParams(temperature=0, max_tokens=48, structured_outputs={"regex": "(area|perimeter)+"})]

    def run(llm):
        outs = llm.chat([GROUNDED[0]] * len(batch), batch, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    got = run(spec_llm)
    assert got == run(smollm2_quantized_llm)
    assert len(got[2]) >= 40 and all(len(t) > 0 for t in got)


def test_counters_reach_the_engine_stats(spec_llm):
    spec_llm.chat(GROUNDED[1], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    stats = spec_llm.engine.stats()
    assert stats["spec_decode_num_drafts_total"] > 0
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_accepted_tokens_total"] > 0
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_decode_num_accepted_tokens_total"]
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(3))  # a draft is kept only after those before it


def test_the_float_model_drafted_by_its_quantized_file_decodes_as_without(compile_cache_dir, smollm2_llm):
    """draft_model as the issue asks it: the embedded SmolLM2 in float32 (its GGUF's weights dequantized) drafted by
    the same file's Q4_1 weights; greedy output token for token the float model's, most drafts kept."""
    draft = {"method": "draft_model", "quantization": "auto", "num_speculative_tokens": 5,
             "disable_by_batch_size": None}
    spec = LLM(compilation_cache_dir=compile_cache_dir, speculative_config=draft, **ENGINE_OPTIONS)
    params = SamplingParams(temperature=0, max_tokens=64)
    got = [o.outputs[0].token_ids for o in spec.chat(GROUNDED + OPEN, params, use_tqdm=False)]
    assert got == [o.outputs[0].token_ids for o in smollm2_llm.chat(GROUNDED + OPEN, params, use_tqdm=False)]
    assert spec.spec_decode_stats.acceptance_rate > 0.5
    bm = spec.engine.block_manager
    assert bm.num_free_pages == bm.num_pages
