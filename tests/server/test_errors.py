"""Every error status, in OpenAI's error shape. BAD_INPUTS doubles as the table in the issue note."""

import json
import time

import pytest
import requests

from tests.server.conftest import API_KEY, Server, serve_mode_fixtures

server, client = serve_mode_fixtures()  # each test in both serve modes

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]
BIG_INT = "1" + "0" * 5000  # more digits than Python's int() converts by default
DEEP = "[" * 100_000 + "]" * 100_000


def _raw(text: str) -> bytes:
    return text.encode()


# Sampling options: one validation (SamplingParams, then the engine's limits), so chat and completions reject the
# same things. (name, extra body fields or raw JSON fragment, param)
SAMPLING = [
    ("max_tokens beyond the context left", {"max_tokens": 100_000}, "max_tokens"),
    ("max_tokens = 0", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens a string", {"max_tokens": "12"}, "max_tokens"),
    ("n above the server's maximum", {"n": 17}, "n"),
    ("n = 0", {"n": 0}, "n"),
    ("n true", {"n": True}, "n"),
    ("temperature above 2", {"temperature": 3}, "temperature"),
    ("temperature NaN", ', "temperature": NaN', "temperature"),
    ("top_p Infinity", ', "top_p": Infinity', "top_p"),
    ("presence_penalty -1e999", ', "presence_penalty": -1e999', "presence_penalty"),
    ("frequency_penalty 3", {"frequency_penalty": 3}, "frequency_penalty"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty"),
    ("top_k 10**30", {"top_k": 10**30}, "top_k"),
    ("min_p 1.5", {"min_p": 1.5}, "min_p"),
    ("min_tokens > max_tokens", {"max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("301 logit_bias entries", {"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ("logit_bias id outside the vocabulary", {"logit_bias": {"49152": 1}}, "logit_bias"),
    ("logit_bias key not a token id", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias value 1000", {"logit_bias": {"5": 1000}}, "logit_bias.5"),
    ("seed 2**64", {"seed": 2**64}, "seed"),
    ("seed 1.5", {"seed": 1.5}, "seed"),
    ("17 stop strings", {"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ("stop string of 10k characters", {"stop": "x" * 10_000}, "stop"),
    ("empty stop string", {"stop": [""]}, "stop.0"),
    ("stop a number", {"stop": 5}, "stop"),
    ("stop_token_ids outside the vocabulary", {"stop_token_ids": [10**6]}, "stop_token_ids"),
    ("empty cache_salt", {"cache_salt": ""}, "cache_salt"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("an integer of 5000 digits", ', "max_tokens": ' + BIG_INT, None),
    ("model name of 300 characters", {"model": "m" * 300}, "model"),
    ("an invalid JSON schema", {"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs"),
    ("a schema that is not JSON", {"structured_outputs": {"json": "{nope"}}, "structured_outputs"),
    ("an unparsable Lark grammar", {"structured_outputs": {"grammar": "start: ("}}, "structured_outputs"),
    ("a GBNF grammar with an undefined rule", {"structured_outputs": {"grammar": "root ::= nothing"}},
     "structured_outputs"),
    ("an unclosed regex group", {"structured_outputs": {"regex": "(("}}, "structured_outputs"),
    ("two constraints at once", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("an empty choice list", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("structured_outputs and response_format", {"structured_outputs": {"regex": "a"},
                                                "response_format": {"type": "json_object"}}, "structured_outputs"),
    ("response_format json_schema without a schema object", {"response_format": {"type": "json_schema"}},
     "response_format"),
    ("response_format of an unknown type", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("response_format with an invalid schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}}, "structured_outputs"),
]
CHAT_ONLY = [
    ("top_logprobs 21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("top_logprobs without logprobs", {"top_logprobs": 2}, "top_logprobs"),
    ("max_completion_tokens beyond the context", {"max_completion_tokens": 10**6}, "max_tokens"),
    ("messages longer than the context", {"messages": [{"role": "user", "content": "hello " * 1100}]}, "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("image content part to a text model", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                                       "image_url": {"url": "x"}}]}]},
     "messages"),
    ("image_url part without its url", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0"),
    ("unknown content part type", {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     "messages.0.content.0.type"),
    ("text part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages.0.content.0"),
    ("empty messages", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hi"}, "messages"),
    ("whitespace-only messages", {"messages": [{"role": "user", "content": " \n\t "}]}, "messages"),
    ("lone surrogate in content", ', "messages": [{"role": "user", "content": "a\\ud800b"}]', "messages.0.content"),
    ("900 KB message (refused before tokenizing)", {"messages": [{"role": "user", "content": "word " * 180_000}]},
     "messages"),
    ("chat_template_kwargs overriding the server", {"chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs"),
    ("a tool without its function", {"tools": [{"type": "function"}]}, "tools.0.function"),
    ("tool_choice naming a missing tool", {"tools": [{"type": "function", "function": {"name": "f"}}],
                                           "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ("tool_choice required without tools", {"tool_choice": "required"}, "tool_choice"),
    ("tool parameters that are no JSON schema", {"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools"),
    ("two tools of one name", {"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
    ("a tool name with spaces", {"tools": [{"type": "function", "function": {"name": "f g"}}]},
     "tools.0.function.name"),
]
COMPLETION_ONLY = [
    ("logprobs 21", {"logprobs": 21}, "logprobs"),
    ("prompt token id outside the vocabulary", {"prompt": [1, 10**7]}, "prompt"),
    ("negative prompt token id", {"prompt": [1, -5]}, "prompt"),
    ("float prompt token ids", {"prompt": [1.5, 2.0]}, "prompt"),
    ("boolean prompt token ids", {"prompt": [True, False]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("whitespace-only prompt", {"prompt": "   \n"}, "prompt"),
    ("empty prompt list", {"prompt": []}, "prompt"),
    ("empty token list in a batch", {"prompt": [[1, 2], []]}, "prompt"),
    ("prompt longer than the context", {"prompt": "hello " * 1100}, "prompt"),
    ("900 KB prompt (refused before tokenizing)", {"prompt": "word " * 180_000}, "prompt"),
    ("lone surrogate in the prompt", ', "prompt": "x\\udfffy"', "prompt"),
    ("prompt_logprobs with stream", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("prompt_logprobs 21", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("suffix", {"suffix": "end"}, "suffix"),
    ("best_of different from n", {"best_of": 3}, "best_of"),
    ("100 prompts x n=16 beyond capacity", {"prompt": [[1, 2]] * 100, "n": 16}, "n"),
]
CHAT_BASE, COMPLETION_BASE = {"messages": CHAT}, {"prompt": "hi"}


def _body(base: dict, extra) -> dict | bytes:
    if isinstance(extra, str):  # a raw JSON fragment: values json.dumps cannot write (NaN, huge ints, surrogates)
        return _raw(json.dumps(base)[:-1] + extra + "}")
    return {**base, **extra}


# (name, method, path, body (dict, or raw bytes), headers, expected status, expected param)
BAD_INPUTS = (
    [(f"chat: {n}", "post", "/v1/chat/completions", _body(CHAT_BASE, e), AUTH, 400, p) for n, e, p in SAMPLING]
    + [(f"completions: {n}", "post", "/v1/completions", _body(COMPLETION_BASE, e), AUTH, 400, p)
       for n, e, p in SAMPLING]
    + [(f"chat: {n}", "post", "/v1/chat/completions", _body(CHAT_BASE, e), AUTH, 400, p) for n, e, p in CHAT_ONLY]
    + [(f"completions: {n}", "post", "/v1/completions", _body(COMPLETION_BASE, e), AUTH, 400, p)
       for n, e, p in COMPLETION_ONLY]
    + [
        ("tokenize: neither prompt nor messages", "post", "/tokenize", {}, AUTH, 400, "prompt"),
        ("tokenize: both prompt and messages", "post", "/tokenize", {"prompt": "x", "messages": CHAT}, AUTH, 400,
         "prompt"),
        ("tokenize: empty prompt", "post", "/tokenize", {"prompt": ""}, AUTH, 400, "prompt"),
        ("tokenize: lone surrogate", "post", "/tokenize", _raw('{"prompt": "\\ud800"}'), AUTH, 400, "prompt"),
        ("tokenize: unknown role", "post", "/tokenize", {"messages": [{"role": "x", "content": "y"}]}, AUTH, 400,
         "messages.0.role"),
        ("tokenize: no API key", "post", "/tokenize", {"prompt": "x"}, {}, 401, None),
        ("detokenize: token outside the vocabulary", "post", "/detokenize", {"tokens": [1, 10**6]}, AUTH, 400,
         "tokens"),
        ("detokenize: tokens as strings", "post", "/detokenize", {"tokens": ["a"]}, AUTH, 400, "tokens.0"),
        ("detokenize: no API key", "post", "/detokenize", {"tokens": [1]}, {}, 401, None),
        ("body is not JSON", "post", "/v1/completions", b"{not json", AUTH, 400, None),
        ("body is a JSON array", "post", "/v1/chat/completions", b"[1, 2]", AUTH, 400, None),
        ("body is not UTF-8", "post", "/v1/completions", b'{"prompt": "\xff\xfe"}', AUTH, 400, None),
        ("JSON nested 100000 deep", "post", "/v1/chat/completions", DEEP.encode(), AUTH, 400, None),
        ("JSON nested 40 deep in a field", "post", "/v1/chat/completions",
         {"messages": CHAT, "chat_template_kwargs": {"x": json.loads("[" * 40 + "]" * 40)}}, AUTH, 400, None),
        ("messages missing", "post", "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}, AUTH, 400,
         "messages"),
        ("no API key", "post", "/v1/chat/completions", {"messages": CHAT}, {}, 401, None),
        ("wrong API key", "get", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
        ("unknown model", "post", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, AUTH, 404, "model"),
        ("unknown route", "get", "/v1/nothing", None, AUTH, 404, None),
        ("wrong method", "get", "/v1/chat/completions", None, AUTH, 405, None),
        ("body over 1 MiB", "post", "/v1/completions", {"prompt": "x" * (1 << 20)}, AUTH, 413, None),
    ])


def check_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    body = resp.json() if callable(resp.json) else resp.json  # requests, or Flask's test client
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize(("name", "method", "path", "body", "headers", "status", "param"), BAD_INPUTS,
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(server, name, method, path, body, headers, status, param):
    kwargs = {"data": body, "headers": {**headers, "Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body, "headers": headers}
    start = time.monotonic()
    resp = getattr(requests, method)(server.url + path, timeout=60, **kwargs)
    took = time.monotonic() - start
    check_error(resp, status, param)
    assert took < 1.0, f"{took:.2f} s"
    m = server.metrics()  # nothing was admitted, nothing leaked
    assert m["jaxllm_num_requests_running"] == 0 and m["jaxllm_num_requests_waiting"] == 0
    assert m["jaxllm_kv_cache_free_pages"] == m["jaxllm_kv_cache_pages"]



def test_openai_client_raises_typed_errors(client):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=5)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


@pytest.fixture(scope="module")
def tiny_queue_server(tmp_path_factory, compile_cache_dir):
    srv = Server({"JAXLLM_MAX_NUM_SEQS": "1", "JAXLLM_MAX_NUM_BATCHED_TOKENS": "16", "JAXLLM_MAX_WAITING_REQUESTS": "1",
                  "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir},
                 tmp_path_factory.mktemp("queue") / "server.log")
    yield srv
    srv.stop()


def test_queue_full_gives_429(tiny_queue_server):
    url = tiny_queue_server.url + "/v1/completions"
    long = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    streams = [requests.post(url, json=long, stream=True, timeout=60) for _ in range(2)]  # running + waiting
    try:
        for s in streams:
            assert s.status_code == 200
        check_error(requests.post(url, json={"prompt": "x", "max_tokens": 1}, timeout=60), 429)
    finally:
        for s in streams:
            s.close()


def test_dead_engine_gives_503(tiny_model_dir, compile_cache_dir):
    """In-process app on a tiny model whose engine step fails: /health and generation answer 503."""
    import time

    from jaxllm.engine.config import EngineConfig
    from jaxllm.engine.llm_engine import LLMEngine
    from server.app import create_app
    from server.settings import ServerSettings

    folder, _ = tiny_model_dir("llama")
    cfg = EngineConfig(model=str(folder), dtype="float32", max_num_seqs=2, max_num_batched_tokens=8, num_pages=16,
                       max_model_len=64, page_size=4, compilation_cache_dir=compile_cache_dir)
    engine = LLMEngine(cfg)

    def broken_step():
        raise RuntimeError("device lost")

    engine.step = broken_step
    app = create_app(ServerSettings(engine=cfg), engine=engine)
    http = app.test_client()
    assert http.get("/health").status_code == 200
    first = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    check_error(first, 503)  # the request that hit the failure is answered, not left hanging
    deadline = time.monotonic() + 5
    while app.extensions["jaxllm"].loop.alive and time.monotonic() < deadline:
        time.sleep(0.01)
    assert http.get("/health").status_code == 503
    check_error(http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}), 503)
    assert json.loads(http.get("/v1/nothing").data)["error"]["message"].startswith("no route")
