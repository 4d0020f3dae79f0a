"""The OpenAI API over HTTP with the official client, against a real gunicorn process: in both serve modes that
run on this host (the engine in the worker; two API workers sharing an engine-core process)."""

import time

import requests

from tests.server.conftest import API_KEY, serve_mode_fixtures

server, client = serve_mode_fixtures()

CHAT = [{"role": "user", "content": "Name three fruits."}]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def tokenize(server, **body):
    return requests.post(server.url + "/tokenize", json=body, headers=AUTH, timeout=30).json()


def test_the_mode_is_the_one_named(server, request):
    two_workers = "2-api-workers" in request.node.callspec.id
    assert (server.core_pid() is not None) == two_workers
    assert len(server.api_worker_pids()) == (2 if two_workers else 1)


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct"]
    assert requests.get(server.url + "/health", timeout=5).json() == {"status": "ok"}
    assert requests.get(server.url + "/ping", timeout=5).status_code == 200
    assert requests.get(server.url + "/version", timeout=5).json()["version"]


def test_chat_non_streaming_with_usage_matching_tokenize(server, client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == tokenize(server, messages=CHAT)["count"]
    completion_ids = tokenize(server, prompt=choice.message.content, add_special_tokens=False)["tokens"]
    # the EOS token that ended the answer is counted but not shown
    assert r.usage.completion_tokens in (len(completion_ids), len(completion_ids) + 1)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0,
                                          max_tokens=30).choices[0].message.content
    chunks = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0,
                                                 max_tokens=30, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # really streamed


def test_completions_streaming_and_not(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The three primary colors are",
                                  max_tokens=12, temperature=0)
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The three primary colors are",
                                         max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    echo = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=3, temperature=0,
                                     echo=True)
    assert echo.choices[0].text.startswith("Hello")


def test_n_2_and_seed_reproducibility(client):
    kw = dict(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=1.0, max_tokens=25, n=2, seed=42)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    c = client.chat.completions.create(**{**kw, "seed": 43})
    assert [x.message.content for x in c.choices] != [x.message.content for x in a.choices]


def test_logprobs(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy: the chosen token is the top one
    comp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Paris is", max_tokens=4,
                                     temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == comp.choices[0].text


def test_stop_strings(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4, 5, 6,", max_tokens=30,
                                  temperature=0, stop=[" 9"])
    assert r.choices[0].finish_reason == "stop" and " 9" not in r.choices[0].text
    assert r.choices[0].text.rstrip(",").endswith("8")


def test_request_id_and_extras(server):
    r = requests.post(server.url + "/v1/chat/completions", headers={**AUTH, "X-Request-Id": "abc-123"},
                      json={"messages": CHAT, "max_tokens": 5, "top_k": 1, "min_p": 0.1, "repetition_penalty": 1.1,
                            "min_tokens": 5, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "abc-123"
    assert r.json()["id"] == "chatcmpl-abc-123" and r.json()["usage"]["completion_tokens"] == 5
    assert requests.get(server.url + "/health", timeout=5).headers["X-Request-Id"]


def test_detokenize_round_trip(server):
    ids = tokenize(server, prompt="héllo wörld")["tokens"]
    r = requests.post(server.url + "/detokenize", json={"tokens": ids}, headers=AUTH, timeout=5)
    assert r.json()["prompt"] == "héllo wörld"


def test_metrics_exposes_engine_and_latency(server, client):
    """Every scrape counts every request in the latency histograms, whichever API worker served it and whichever
    answers the scrape; the engine's counters follow within its stats interval."""
    before = server.metrics()
    for _ in range(2):
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    deadline = time.monotonic() + 5
    for _ in range(6):  # fresh connections: with two API workers, both answer some of them
        m = server.metrics()
        for name in ("jaxllm_num_requests_running", "jaxllm_num_requests_waiting", "jaxllm_kv_cache_usage_perc",
                     "jaxllm_prompt_tokens_total", "jaxllm_generation_tokens_total",
                     "jaxllm_time_to_first_token_seconds_count", "jaxllm_inter_token_latency_seconds_count",
                     "jaxllm_e2e_request_latency_seconds_count"):
            assert name in m, name
        for name in ("jaxllm_e2e_request_latency_seconds_count", "jaxllm_time_to_first_token_seconds_count"):
            assert m[name] >= before[name] + 2, (name, before[name], m[name])
    while m["jaxllm_generation_tokens_total"] < before["jaxllm_generation_tokens_total"] + 4:
        assert time.monotonic() < deadline, (before["jaxllm_generation_tokens_total"], m)
        time.sleep(0.05)
        m = server.metrics()


def test_greedy_chat_over_http_equals_llm_chat(client, smollm2_llm):
    """The server runs with the same engine options as the in-process smollm2_llm (tests/conftest.py)."""
    from jaxllm import SamplingParams

    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Why do cats purr?"}]
    http = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0,
                                          max_tokens=48).choices[0].message.content
    local = smollm2_llm.chat(messages, SamplingParams(temperature=0, max_tokens=48),
                             use_tqdm=False)[0].outputs[0].text
    assert http == local


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """OpenAI's legacy echo + logprobs (what evaluation harnesses send): the prompt's tokens with their logprobs
    (the first None), then the generated ones; a prompt token scores as it did when the model generated it."""
    prompt = "The capital of France is"
    gen = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=3, temperature=0,
                                    logprobs=1)
    ids = tokenize(server, prompt=prompt)["tokens"]
    generated = tokenize(server, prompt=gen.choices[0].text, add_special_tokens=False)["tokens"]
    assert len(generated) == 3  # (re-tokenizing the text gives back the 3 tokens)
    scored = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids + generated, max_tokens=1,
                                       temperature=0, logprobs=2, echo=True)
    lp = scored.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 3 + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    assert scored.choices[0].text.startswith(prompt + gen.choices[0].text)
    for got, want in zip(lp.token_logprobs[len(ids):len(ids) + 3], gen.choices[0].logprobs.token_logprobs,
                         strict=True):
        assert abs(got - want) < 2e-3, (got, want)  # prefill rows score what decode steps sampled
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=2, temperature=0,
                                       logprobs=0, echo=True, stream=True)
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= len(ids)
    np_scored = scored.choices[0].logprobs.token_logprobs[1:len(ids)]
    assert all(abs(a - b) < 2e-3 for a, b in zip(first.token_logprobs[1:len(ids)], np_scored, strict=True))


def test_prompt_logprobs_as_vllm_returns_them(server):
    for path, body in (("/v1/completions", {"prompt": "Hello there"}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        r = requests.post(server.url + path, headers=AUTH, timeout=120,
                          json={"model": "SmolLM2-135M-Instruct", "max_tokens": 2, "temperature": 0,
                                "prompt_logprobs": 2, **body}).json()
        plp = r["choices"][0]["prompt_logprobs"] if path == "/v1/completions" else r["prompt_logprobs"]
        assert plp[0] is None and len(plp) == r["usage"]["prompt_tokens"]
        for entry in plp[1:]:
            assert 2 <= len(entry) <= 3 and {e["rank"] for e in entry.values()} >= {1, 2}
            assert all(e["logprob"] <= 0 and isinstance(e["decoded_token"], str) for e in entry.values())


def test_return_token_ids_streamed_and_not(server, client):
    """vLLM's return_token_ids: the ids behind the text, whole or chunk by chunk (the openai client keeps fields it
    does not know in `model_extra`)."""
    prompt = "The three primary colors are"
    ids = tokenize(server, prompt=prompt)["tokens"]
    extra = {"return_token_ids": True}
    whole = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body=extra).choices[0]
    assert whole.model_extra["prompt_token_ids"] == ids and len(whole.model_extra["token_ids"]) == 12
    assert tokenize(server, prompt=whole.text, add_special_tokens=False)["tokens"] == whole.model_extra["token_ids"]
    chunks = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True, extra_body=extra))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == whole.model_extra["token_ids"]
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0, max_tokens=20,
                                          extra_body=extra)
    assert chat.model_extra["prompt_token_ids"] == tokenize(server, messages=CHAT)["tokens"]
    streamed = list(client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, temperature=0,
                                                   max_tokens=20, stream=True, extra_body=extra))
    assert streamed[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    got = [t for c in streamed if c.choices for t in c.choices[0].model_extra.get("token_ids", [])]
    assert got == chat.choices[0].model_extra["token_ids"] and len(got) == chat.usage.completion_tokens
