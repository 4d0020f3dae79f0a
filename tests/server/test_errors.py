"""Every error status, in OpenAI's error shape. BAD_INPUTS doubles as the table in the issue note."""

import json

import pytest
import requests

from tests.server.conftest import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hi"}]

# (name, method, path, body or raw bytes, headers, expected status, expected param)
BAD_INPUTS = [
    ("temperature out of range", "post", "/v1/chat/completions", {"messages": CHAT, "temperature": 3}, AUTH, 400,
     "temperature"),
    ("n = 0", "post", "/v1/chat/completions", {"messages": CHAT, "n": 0}, AUTH, 400, "n"),
    ("messages missing", "post", "/v1/chat/completions", {"model": "SmolLM2-135M-Instruct"}, AUTH, 400,
     "messages"),
    ("empty messages", "post", "/v1/chat/completions", {"messages": []}, AUTH, 400, "messages"),
    ("unknown role", "post", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, AUTH,
     400, "messages.0.role"),
    ("image content part", "post", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, AUTH, 400,
     "messages"),
    ("top_logprobs without logprobs", "post", "/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, AUTH,
     400, "top_logprobs"),
    ("five stop strings", "post", "/v1/chat/completions", {"messages": CHAT, "stop": list("abcde")}, AUTH, 400,
     "stop"),
    ("tools", "post", "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, AUTH, 400,
     "tools"),
    ("logit_bias key not a token id", "post", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}},
     AUTH, 400, "logit_bias"),
    ("max_tokens = 0", "post", "/v1/completions", {"prompt": "x", "max_tokens": 0}, AUTH, 400, "max_tokens"),
    ("min_tokens > max_tokens", "post", "/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 5},
     AUTH, 400, "min_tokens"),
    ("prompt token id out of vocab", "post", "/v1/completions", {"prompt": [1, 10**7]}, AUTH, 400, "prompt"),
    ("empty prompt", "post", "/v1/completions", {"prompt": ""}, AUTH, 400, "prompt"),
    ("prompt longer than the context", "post", "/v1/completions", {"prompt": "hello " * 1100}, AUTH, 400,
     "prompt"),
    ("body is not JSON", "post", "/v1/completions", b"{not json", AUTH, 400, None),
    ("no API key", "post", "/v1/chat/completions", {"messages": CHAT}, {}, 401, None),
    ("wrong API key", "get", "/v1/models", None, {"Authorization": "Bearer nope"}, 401, None),
    ("unknown model", "post", "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}, AUTH, 404, "model"),
    ("unknown route", "get", "/v1/nothing", None, AUTH, 404, None),
    ("wrong method", "get", "/v1/chat/completions", None, AUTH, 405, None),
    ("body over 1 MiB", "post", "/v1/completions", {"prompt": "x" * (1 << 20)}, AUTH, 413, None),
]


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
    resp = getattr(requests, method)(server.url + path, timeout=60, **kwargs)
    check_error(resp, status, param)


def test_errors_leak_no_pages(server):
    m = server.metrics()
    assert m["jaxllm_kv_cache_free_pages"] == m["jaxllm_kv_cache_pages"]
    assert m["jaxllm_num_requests_running"] == 0


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
