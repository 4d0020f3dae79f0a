"""The offline API as code written for vLLM uses it: each test is written the way vLLM's documented offline examples
(examples/offline_inference/basic/ and the logprobs / structured-outputs / beam-search docs) call it, with
`from jaxllm ...` where they have `from vllm ...` and this project's models (the embedded SmolLM2, tiny random
HF models) where they name hub models. What each example prints is asserted instead, against transformers or
sentence-transformers where a number can be checked."""

import json

import numpy as np
import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.beam_search import BeamSearchParams, beam_score
from jaxllm.inputs import TextPrompt, TokensPrompt
from jaxllm.sampling_params import StructuredOutputsParams

PROMPTS = ["Hello, my name is", "The president of the United States is", "The capital of France is",
           "The future of AI is"]


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm  # LLM(model=...) with the test session's engine options (one engine for all tests)


def test_basic(llm):
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=0)
    outputs = llm.generate(PROMPTS, sampling_params)
    assert len(outputs) == len(PROMPTS)
    for output, prompt in zip(outputs, PROMPTS, strict=True):
        generated_text = output.outputs[0].text
        assert output.prompt == prompt and generated_text and len(output.outputs[0].token_ids) == 8
    # prompts as vLLM's input types: a TextPrompt is the text, a TokensPrompt its token ids
    tokens = llm.get_tokenizer().encode(PROMPTS[2])
    greedy = SamplingParams(temperature=0, max_tokens=8)
    by_text, by_dict, by_ids = llm.generate([PROMPTS[2], TextPrompt(prompt=PROMPTS[2]),
                                             TokensPrompt(prompt_token_ids=tokens)], greedy, use_tqdm=False)
    assert by_text.outputs[0].text == by_dict.outputs[0].text == by_ids.outputs[0].text
    assert by_ids.prompt_token_ids == tokens


def test_chat(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=12)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    assert outputs[0].outputs[0].text
    # a batch of conversations: each answered as if alone
    batch = llm.chat([conversation, conversation[:2]], sampling_params, use_tqdm=False)
    assert batch[0].outputs[0].text == outputs[0].outputs[0].text
    alone = llm.chat(conversation[:2], sampling_params, use_tqdm=False)
    assert batch[1].outputs[0].text == alone[0].outputs[0].text
    # the model's own chat template, ending with the assistant's turn opened
    prompt = llm.get_tokenizer().decode(outputs[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.count("<|im_start|>") == 5 and prompt.rstrip().endswith("<|im_start|>assistant")


def test_logprobs(llm):
    sampling_params = SamplingParams(temperature=0, max_tokens=6, logprobs=5)
    output = llm.generate(["The capital of France is"], sampling_params, use_tqdm=False)[0]
    completion = output.outputs[0]
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    total = 0.0
    for token_id, step in zip(completion.token_ids, completion.logprobs, strict=True):
        chosen = step[token_id]
        total += chosen.logprob
        assert chosen.rank == 1  # greedy: the likeliest token
        assert chosen.decoded_token == llm.get_tokenizer().decode([token_id], skip_special_tokens=False)
        others = sorted(step.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in others] == list(range(1, 6))
        assert all(a.logprob >= b.logprob for a, b in zip(others, others[1:], strict=False))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # a sampled token that is not the likeliest has its own rank (a bias picks it; ranks are the model's own)
    fifth = next(t for t, lp in completion.logprobs[0].items() if lp.rank == 5)
    forced = SamplingParams(temperature=0, max_tokens=1, logprobs=2, logit_bias={fifth: 100})
    out = llm.generate(["The capital of France is"], forced, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [fifth] and out.logprobs[0][fifth].rank == 5
    assert sorted(lp.rank for lp in out.logprobs[0].values()) == [1, 2, 5]
    # prompt logprobs: None for the first token, then each prompt token's own entry
    prompt = llm.generate("The capital of France is", SamplingParams(max_tokens=1, prompt_logprobs=2),
                          use_tqdm=False)[0]
    assert prompt.prompt_logprobs[0] is None and len(prompt.prompt_logprobs) == len(prompt.prompt_token_ids)
    for token, entry in zip(prompt.prompt_token_ids[1:], prompt.prompt_logprobs[1:], strict=True):
        assert token in entry and {lp.rank for lp in entry.values()} >= {1, 2} and entry[token].logprob <= 0


def test_structured_outputs(llm):
    structured_outputs_params = StructuredOutputsParams(choice=["Positive", "Negative"])
    sampling_params = SamplingParams(structured_outputs=structured_outputs_params, temperature=0)
    outputs = llm.generate("Classify this sentiment: vLLM is wonderful!", sampling_params=sampling_params,
                           use_tqdm=False)
    assert outputs[0].outputs[0].text in ("Positive", "Negative")

    schema = {"type": "object", "properties": {"brand": {"type": "string", "maxLength": 12},
                                               "year": {"type": "integer"}},
              "required": ["brand", "year"], "additionalProperties": False}
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), temperature=0, max_tokens=60)
    text = llm.generate("Generate a JSON with the brand and year of a car", params, use_tqdm=False)[0].outputs[0].text
    car = json.loads(text)
    assert set(car) == {"brand", "year"} and isinstance(car["year"], int)

    # vLLM's example has \w+ parts; bounded here so that a 135M model that loops still ends within max_tokens
    regex = SamplingParams(structured_outputs=StructuredOutputsParams(regex=r"[a-z]{1,10}@[a-z]{1,10}\.com\n"),
                           stop=["\n"], temperature=0, max_tokens=40)
    email = llm.generate("Generate an email address for Alan Turing, who works in Enigma.", regex,
                         use_tqdm=False)[0].outputs[0].text
    import re

    assert re.fullmatch(r"[a-z]{1,10}@[a-z]{1,10}\.com", email), email


def test_beam_search(llm):
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outputs = llm.beam_search([{"prompt": "The capital of France is"}, "Hello, my name is"], params)
    assert len(outputs) == 2
    tok = llm.get_tokenizer()
    for output, prompt in zip(outputs, ["The capital of France is", "Hello, my name is"], strict=True):
        seqs = output.sequences
        assert len(seqs) == 3
        scores = [beam_score(s.tokens, s.cum_logprob, llm.engine.eos_token_ids, 1.0) for s in seqs]
        assert scores == sorted(scores, reverse=True)  # best first (length penalty 1)
        assert len({tuple(s.tokens) for s in seqs}) == 3
        prompt_ids = tok.encode(prompt)
        for s in seqs:
            assert s.tokens[:len(prompt_ids)] == prompt_ids and s.text.startswith(prompt)
            generated = s.tokens[len(prompt_ids):]
            assert len(generated) == len(s.logprobs) and (len(generated) == 5 or s.finish_reason == "stop")
            assert s.cum_logprob == pytest.approx(sum(step[t].logprob for t, step in zip(generated, s.logprobs,
                                                                                          strict=True)), abs=1e-4)
    # one beam is greedy decoding
    greedy = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    [one] = llm.beam_search("The capital of France is", BeamSearchParams(beam_width=1, max_tokens=5))[0].sequences
    n = len(tok.encode("The capital of France is"))
    assert one.tokens[n:] == greedy.token_ids
    assert one.cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-4)
    with pytest.raises(ValueError):
        BeamSearchParams(beam_width=11, max_tokens=4)  # candidates are the top 2 x beam_width logprobs (20 at most)


POOLING_OPTIONS = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, num_pages=128, max_model_len=256)


@pytest.mark.slow
def test_embed(tiny_embedding_dir, compile_cache_dir):
    model = tiny_embedding_dir("mean")  # a sentence-transformers model, as intfloat/e5-small in vLLM's example
    llm = LLM(model=str(model), runner="pooling", enforce_eager=True, compilation_cache_dir=compile_cache_dir,
              **POOLING_OPTIONS)
    outputs = llm.embed(PROMPTS)
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(str(model), device="cpu").encode(PROMPTS, convert_to_numpy=True)
    for prompt, output, expected in zip(PROMPTS, outputs, want, strict=True):
        embeds = output.outputs.embedding
        assert isinstance(embeds, list) and all(isinstance(x, float) for x in embeds) and len(embeds) == 64
        assert output.prompt == prompt
        np.testing.assert_allclose(embeds, expected, atol=1e-4)
    # encode: the same vectors as arrays (vLLM's PoolingRequestOutput.outputs.data)
    encoded = llm.encode(PROMPTS)  # the same batch: the same steps (an encoder's XLA dots round by step shape)
    for got, want in zip(encoded, outputs, strict=True):
        np.testing.assert_array_equal(got.outputs.data, np.asarray(want.outputs.embedding, np.float32))


@pytest.mark.slow
def test_a_causal_model_as_an_embedder(tiny_folder, compile_cache_dir):
    """runner="pooling" (or vLLM's older task="embed") on a causal LM: its last token's final hidden state,
    normalized, as transformers computes it; it still generates."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    llm = LLM(model=str(tiny_folder), task="embed", compilation_cache_dir=compile_cache_dir, **POOLING_OPTIONS)
    texts = ["The quick brown fox jumps over the lazy dog.", "A city by the sea"]
    got = np.array([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    tok = AutoTokenizer.from_pretrained(tiny_folder)
    model = AutoModel.from_pretrained(tiny_folder, torch_dtype=torch.float32)
    for text, vec in zip(texts, got, strict=True):
        ids = llm.get_tokenizer().encode(text)
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()
        np.testing.assert_allclose(vec, hidden / np.linalg.norm(hidden), atol=1e-4)
        assert ids == tok(text)["input_ids"]
    assert llm.generate("Hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="contradicts"):
        LLM(model=str(tiny_folder), task="embed", runner="generate")


@pytest.mark.slow
def test_classify_and_score(tiny_encoder_dir, compile_cache_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = tiny_encoder_dir("bert", "classifier")  # a cross-encoder, as vLLM's classify / score examples use
    llm = LLM(model=str(model), runner="pooling", enforce_eager=True, compilation_cache_dir=compile_cache_dir,
              **POOLING_OPTIONS)
    outputs = llm.classify(PROMPTS)
    hf = AutoModelForSequenceClassification.from_pretrained(model, torch_dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        probs = output.outputs.probs
        with torch.no_grad():
            logits = hf(**tok(prompt, return_tensors="pt")).logits[0]
        assert isinstance(probs, list) and output.outputs.num_classes == len(logits) == 1
        np.testing.assert_allclose(probs, torch.sigmoid(logits).numpy(), atol=1e-5)

    text_1 = "What is the capital of France?"
    texts_2 = ["The capital of Brazil is Brasilia.", "The capital of France is Paris."]
    scores = llm.score(text_1, texts_2)
    for text_2, output in zip(texts_2, scores, strict=True):
        with torch.no_grad():
            logit = hf(**tok(text_1, text_2, return_tensors="pt")).logits[0, 0]
        assert output.outputs.score == pytest.approx(float(torch.sigmoid(logit)), abs=1e-5)


def test_engine_options_as_vllm_names_them(tiny_folder, compile_cache_dir):
    """Keywords a vLLM script passes that configure nothing here are accepted; misspelled ones are not."""
    options = {**POOLING_OPTIONS, "max_model_len": 200}
    llm = LLM(model=str(tiny_folder), enforce_eager=True, trust_remote_code=False, disable_log_stats=True, seed=0,
              compilation_cache_dir=compile_cache_dir, **options)
    assert llm.engine.max_model_len == 200
    with pytest.raises(TypeError):
        LLM(max_modle_len=1024)
    with pytest.raises(ValueError, match="task must be one of"):
        LLM(task="translate")
