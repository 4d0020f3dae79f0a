"""One validation for every entry point: SamplingParams checks what needs no model, the engine what needs it;
the Python API, the engine loop (the server's path) and the CLI refuse the same inputs, in the caller's thread."""

import math

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.errors import InvalidRequestError, PromptTooLongError
from jaxllm.sampling_params import SamplingParamsError

BAD_PARAMS = [
    ("n", 0), ("n", True), ("n", 2.0), ("temperature", math.nan), ("temperature", math.inf), ("temperature", 2.5),
    ("temperature", "1"), ("top_p", 0.0), ("top_p", math.nan), ("top_k", -2), ("top_k", 1 << 40), ("min_p", -0.1),
    ("presence_penalty", 2.5), ("frequency_penalty", -math.inf), ("repetition_penalty", 0.0),
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("seed", 1.5), ("max_tokens", 0), ("max_tokens", 1 << 40),
    ("min_tokens", -1), ("logprobs", 21), ("logprobs", -1), ("stop", ["x"] * 17), ("stop", "x" * 257),
    ("stop", [""]), ("stop", "\ud800"), ("stop", 5), ("stop_token_ids", [-1]), ("stop_token_ids", [1] * 65),
    ("logit_bias", {i: 1.0 for i in range(301)}), ("logit_bias", {1: 101.0}), ("logit_bias", {1: math.nan}),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {-1: 1.0}), ("ignore_eos", "yes"),
]


@pytest.mark.parametrize(("field", "value"), BAD_PARAMS, ids=[f"{f}={v!r}"[:40] for f, v in BAD_PARAMS])
def test_bad_sampling_params_name_their_field(field, value):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_good_params_are_normalised():
    p = SamplingParams(stop="end", logit_bias={"5": 1}, top_k=-1, seed=-1, stop_token_ids=[3])
    assert p.stop == ("end",) and p.logit_bias == {5: 1.0} and p.top_k == 0 and p.stop_token_ids == (3,)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir, compile_cache_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), dtype="float32", attn_impl="reference", max_num_seqs=4, max_num_batched_tokens=16,
               num_pages=64, max_model_len=64, page_size=4, max_n=4, compilation_cache_dir=compile_cache_dir)


@pytest.mark.parametrize(("prompt", "params", "param"), [
    ([1] * 70, SamplingParams(), "prompt"),  # longer than the context
    ([1, 2], SamplingParams(max_tokens=63), "max_tokens"),  # 2 + 63 > 64
    ([1, 2], SamplingParams(max_tokens=10, min_tokens=10, n=1), None),  # fine
    ([1, 2], SamplingParams(n=5), "n"),  # above max_n
    ([1, 2], SamplingParams(logit_bias={1024: 1.0}), "logit_bias"),  # outside the vocabulary
    ([1, 2], SamplingParams(stop_token_ids=[5000]), "stop_token_ids"),
    ([1, 1024], SamplingParams(), "prompt"), ([1, -1], SamplingParams(), "prompt"),
    ([1, 2.0], SamplingParams(), "prompt"), ([True], SamplingParams(), "prompt"), ([], SamplingParams(), "prompt"),
    ("text", SamplingParams(), "prompt"),  # this tiny model has no tokenizer
    (b"bytes", SamplingParams(), "prompt"),
])
def test_engine_limits_through_the_python_api_and_the_loop(tiny_llm, prompt, params, param):
    from jaxllm.engine.engine_loop import EngineLoop

    if param is None:
        out = tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 10
        return
    with pytest.raises(InvalidRequestError) as e:
        tiny_llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    assert e.value.param == param
    assert not tiny_llm.engine.has_unfinished_requests()  # nothing was half-added
    if param == "prompt" and prompt == [1] * 70:
        assert isinstance(e.value, PromptTooLongError)
    loop = EngineLoop(tiny_llm.engine)
    try:
        with pytest.raises(InvalidRequestError):
            loop.add_request("x", prompt, params, lambda out: None)
        assert loop.alive
    finally:
        loop.stop()


def test_cli_refuses_what_the_api_refuses(capsys):
    from jaxllm.generate import main

    assert main(["--temperature", "nan", "hi"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["--seed", str(1 << 64), "hi"]) == 2
    assert "seed" in capsys.readouterr().err
