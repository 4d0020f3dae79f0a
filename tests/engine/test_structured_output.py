"""Structured outputs on the embedded SmolLM2: every sampled output satisfies its constraint (JSON schemas
checked with jsonschema, regexes, choices, a Lark grammar), constrained rows leave the others' tokens alone, and
nothing recompiles."""

import json
import re

import jsonschema
import numpy as np
import pytest

from benchmarks.structured_cases import MODELS, PROMPTS
from jaxllm import SamplingParams
from jaxllm.engine import compile_monitor
from jaxllm.engine.structured_output import StructuredOutputError
from jaxllm.errors import InvalidRequestError
from jaxllm.sampling_params import StructuredOutputsParams

pytestmark = pytest.mark.slow


def chat(llm, text):
    return {"prompt_token_ids": llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}],
                                                                        add_generation_prompt=True)}


def test_200_sampled_outputs_of_10_schemas_all_validate(smollm2_llm):
    prompts, params, schemas = [], [], []
    for model, text in zip(MODELS, PROMPTS, strict=True):
        schema = model.model_json_schema()
        for i in range(20):
            prompts.append(chat(smollm2_llm, f"{text} Answer in JSON."))
            params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=300,
                                         structured_outputs={"json": schema}))
            schemas.append(schema)
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, schemas, strict=True):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_regex_choice_and_lark_grammar(smollm2_llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
    choices = ["Paris", "London", "New York City"]
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,4}/'
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    cases = [({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
             ({"regex": regex}, lambda t: re.fullmatch(regex, t)),
             ({"choice": choices}, lambda t: t in choices),
             ({"grammar": lark}, lambda t: re.fullmatch(r"The answer is [0-9]{1,4}\.", t)),
             ({"grammar": gbnf}, lambda t: t in ("color: red", "color: green", "color: blue"))]
    prompts, params, checks = [], [], []
    for spec, check in cases:
        for i in range(6):
            # any JSON object has unbounded strings, where this small model rambles or loops until max_tokens;
            # a repetition penalty and prompts that ask for JSON let it close the object
            free_json = "json_object" in spec
            prompts.append(chat(smollm2_llm, f"Give a JSON object with the name and price of product {i}."
                                if free_json else "What is the capital of France? Say something."))
            params.append(SamplingParams(temperature=0.7 if free_json else 1.0, seed=i, max_tokens=200,
                                         repetition_penalty=1.3 if free_json else 1.0, structured_outputs=spec))
            checks.append(check)
    outs = smollm2_llm.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for out, check, p in zip(outs, checks, params, strict=True):
        c = out.outputs[0]
        if p.structured_outputs.json_object and c.finish_reason == "length":
            # cut by max_tokens inside an unbounded string: still a prefix the grammar accepts, token by token
            fresh = smollm2_llm.engine.grammars.matcher(p.structured_outputs)
            assert fresh.validate_tokens(c.token_ids) == len(c.token_ids) and c.text.startswith("{"), c.text
            continue
        stopped += p.structured_outputs.json_object
        assert c.finish_reason == "stop" and check(c.text), (p.structured_outputs, c.text)
    assert stopped >= 2  # most JSON objects close


def test_n_choices_each_advance_their_own_matcher(smollm2_llm):
    (out,) = smollm2_llm.generate([chat(smollm2_llm, "Pick a color.")],
                                  SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=100,
                                                 structured_outputs={"json": MODELS[3].model_json_schema()}),
                                  use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        MODELS[3].model_validate_json(c.text)


def test_constrained_rows_leave_the_unconstrained_ones_token_for_token_unchanged(smollm2_llm):
    free = [chat(smollm2_llm, f"Tell me a fact about the number {i}.") for i in range(16)]
    free_params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in smollm2_llm.generate(free, free_params, use_tqdm=False)]
    schema = MODELS[0].model_json_schema()
    constrained = [chat(smollm2_llm, "Describe a city in JSON.")] * 16
    before = compile_monitor.snapshot()["compiles"]
    outs = smollm2_llm.generate(
        free + constrained,
        [free_params] * 16 + [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                                             structured_outputs={"json": schema}) for i in range(16)],
        use_tqdm=False)
    assert compile_monitor.snapshot()["compiles"] == before  # same buckets: the mask is an input, not a shape
    assert [o.outputs[0].token_ids for o in outs[:16]] == alone
    for o in outs[16:]:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_logprobs_are_those_of_the_masked_distribution(smollm2_llm):
    (out,) = smollm2_llm.generate([chat(smollm2_llm, "Yes or no?")],
                                  SamplingParams(temperature=0, max_tokens=5, logprobs=5,
                                                 structured_outputs={"choice": ["yes", "no"]}), use_tqdm=False)
    c = out.outputs[0]
    assert c.text in ("yes", "no")
    first = c.logprobs[0]
    allowed = {t for t, lp in first.items() if np.isfinite(lp.logprob)}
    assert c.token_ids[0] in allowed
    # renormalised over what the grammar allows: the probabilities of the finite entries sum to at most 1 and
    # every token outside the grammar has probability 0
    assert sum(np.exp(lp.logprob) for lp in first.values() if np.isfinite(lp.logprob)) <= 1 + 1e-5
    assert all(lp.logprob == -np.inf for t, lp in first.items()
               if not smollm2_llm.get_tokenizer().decode([t]).strip() or
               not ("yes".startswith(smollm2_llm.get_tokenizer().decode([t]).strip()) or
                    "no".startswith(smollm2_llm.get_tokenizer().decode([t]).strip())))


@pytest.mark.parametrize(("spec", "message"), [
    ({"json": {"type": "objectx"}}, "objectx"),
    ({"json": "{not json"}, "structured output"),
    ({"regex": "(("}, "unclosed group"),
    ({"grammar": "start: foo"}, "foo"),
    ({"grammar": "root ::= undefined_rule"}, "undefined_rule"),
])
def test_invalid_constraints_are_refused_with_llguidance_message(smollm2_llm, spec, message):
    with pytest.raises(StructuredOutputError, match=re.escape(message)):
        smollm2_llm.generate(["Hi"], SamplingParams(structured_outputs=spec), use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("spec", [{}, {"json": {}, "regex": "a"}, {"choice": []}, {"regex": ""}, {"jsn": {}},
                                  {"json_object": "yes"}, {"choice": [1, 2]}])
def test_malformed_structured_outputs_params_are_refused(spec):
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs=spec)


def test_params_object_and_dict_are_the_same():
    assert SamplingParams(structured_outputs={"choice": ["a"]}) == \
        SamplingParams(structured_outputs=StructuredOutputsParams(choice=("a",)))


def test_matchers_survive_preemption_and_prefix_cache_hits(compile_cache_dir, smollm2_llm):
    from jaxllm import LLM
    from tests.conftest import ENGINE_OPTIONS

    schema = MODELS[7].model_json_schema()  # Team: the longest answers
    prompts = [chat(smollm2_llm, f"Describe team number {i} in JSON.") for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=200, structured_outputs={"json": schema})
    roomy = [o.outputs[0].text for o in smollm2_llm.generate(prompts, params, use_tqdm=False)]
    again = smollm2_llm.generate(prompts[:2], params, use_tqdm=False)  # the prompts now hit the prefix cache
    assert all(o.num_cached_tokens > 0 for o in again) and [o.outputs[0].text for o in again] == roomy[:2]
    tight = LLM(compilation_cache_dir=compile_cache_dir, **{**ENGINE_OPTIONS, "num_pages": 24})
    outs = [o.outputs[0].text for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert outs == roomy  # a preempted sequence's matcher kept its state through the recomputation
    for text in outs:
        jsonschema.validate(json.loads(text), schema)
