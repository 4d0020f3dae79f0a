"""Multi-LoRA through real gunicorn servers and the `openai` client: adapters picked by a request's ``model``, greedy
tokens equal to transformers + peft (adapters unmerged) in both serve modes (the engine in the worker; two API
workers sharing an engine-core process), /v1/models, runtime loading and unloading, every refusal a 400 (or 404)
that leaves nothing loaded, and the adapters' metrics."""

import json
import os
import shutil

import openai
import pytest
import requests

from tests.lora.test_lora_engine import N, _hf_greedy, _make_adapter, _prompts
from tests.server.conftest import API_KEY, Server, tiny_engine_env

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tiny_folder, tmp_path_factory):
    """name -> (folder, peft model) on the tiny Llama the servers serve (tiny_folder: its weights, a tokenizer)."""
    _, hf_model = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("served_adapters")
    everything = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    made = {"a": _make_adapter(hf_model, root / "a", everything, 8, 11),
            "b": _make_adapter(hf_model, root / "b", ["q_proj", "v_proj", "down_proj"], 4, 12, use_rslora=True),
            "c": _make_adapter(hf_model, root / "c", ["o_proj", "up_proj"], 8, 13)}
    return {"": (None, hf_model), **{k: (root / k, m) for k, m in made.items()}}, root


def _server(tmp_path_factory, tiny_folder, compile_cache_dir, adapters, extra: dict) -> Server:
    table, _ = adapters
    env = {**tiny_engine_env(tiny_folder, compile_cache_dir), "JAXLLM_MAX_LORAS": "2", "JAXLLM_MAX_LORA_RANK": "8",
           "JAXLLM_LORA_MODULES": f"a={table['a'][0]},b={table['b'][0]}", "JAXLLM_MAX_NUM_SEQS": "4",
           "JAXLLM_MAX_NUM_BATCHED_TOKENS": "16", "JAXLLM_NUM_PAGES": "128", "JAXLLM_MAX_MODEL_LEN": "64",
           "JAXLLM_PAGE_SIZE": "4", **extra}
    d = tmp_path_factory.mktemp("lora_server")
    return Server({"JAXLLM_API_KEY": API_KEY}, d / "server.log", engine_env=env)


@pytest.fixture(scope="module", params=["in-process", "2-api-workers"])
def server(request, tmp_path_factory, tiny_folder, compile_cache_dir, adapters):
    _, root = adapters
    extra = {"JAXLLM_ALLOW_RUNTIME_LORA_UPDATING": "true", "JAXLLM_LORA_ROOTS": str(root)} \
        if request.param == "in-process" else {"JAXLLM_API_SERVERS": "2"}
    srv = _server(tmp_path_factory, tiny_folder, compile_cache_dir, adapters, extra)
    srv.mode = request.param
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def _greedy(srv: Server, model: str, prompt: list[int]) -> list[int]:
    r = requests.post(srv.url + "/v1/completions", headers=AUTH, timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": N, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model and body["choices"][0]["prompt_token_ids"] == prompt
    return body["choices"][0]["token_ids"]


def test_requests_pick_their_adapter_by_model_and_equal_peft(server, adapters):
    table, _ = adapters
    models = requests.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()["data"]
    base = models[0]["id"]
    assert [(m["id"], m["parent"]) for m in models] == [(base, None), ("a", base), ("b", base)]
    assert all(str(table["a"][0]) not in json.dumps(m) for m in models)  # no server paths to clients
    prompts = _prompts(21)
    names = ["a", "", "b", "a"]  # adapter a, the base, adapter b, a again: concurrent requests share steps
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda np: _greedy(server, np[0] or base, np[1]), zip(names, prompts, strict=True)))
    want = [_hf_greedy(table[n][1], p) for n, p in zip(names, prompts, strict=True)]
    assert want[0] != want[1] != want[2]  # the adapters matter
    assert got == want
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0)
    assert chat.model == "b" and chat.choices[0].message.content is not None
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert 'jaxllm_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_unknown_adapters_and_adapters_for_pooling_are_refused(server):
    r = requests.post(server.url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "nope", "prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = requests.post(server.url + "/v1/embeddings", headers=AUTH, timeout=30, json={"model": "a", "input": "x"})
    assert r.status_code == 400 and "serves generation only" in r.json()["error"]["message"]


def _load(srv, name, path, **kw):
    return requests.post(srv.url + "/v1/load_lora_adapter", headers=AUTH, timeout=60,
                         json={"lora_name": name, "lora_path": str(path), **kw})


def _unload(srv, name, **kw):
    return requests.post(srv.url + "/v1/unload_lora_adapter", headers=AUTH, timeout=60, json={"lora_name": name, **kw})


def _names(srv):
    return [m["id"] for m in requests.get(srv.url + "/v1/models", headers=AUTH, timeout=10).json()["data"][1:]]


def test_runtime_loading_unloading_and_its_refusals(server, adapters, tmp_path):
    table, root = adapters
    if server.mode != "in-process":  # off there: refused, nothing changes
        r = _load(server, "c", table["c"][0])
        assert r.status_code == 400 and "JAXLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]
        assert _unload(server, "a").status_code == 400 and _names(server) == ["a", "b"]
        return
    prompt = _prompts(22)[0]
    r = _load(server, "c", table["c"][0])
    assert r.status_code == 200 and "added" in r.text
    assert _greedy(server, "c", prompt) == _hf_greedy(table["c"][1], prompt)  # a third adapter: two slots, reused
    bad = root / "bad"
    shutil.copytree(table["a"][0], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "r": 16}))
    outside = tmp_path / "outside"
    shutil.copytree(table["a"][0], outside)
    os.symlink(outside, root / "link")
    refusals = [
        (_load(server, "x", bad), 400, "rank 16 is above max_lora_rank 8"),
        (_load(server, "x", root / "missing"), 400, "no adapter_config.json"),
        (_load(server, "x", root / ".." / "outside"), 400, "outside the folders"),
        (_load(server, "x", root / "link"), 400, "outside the folders"),  # a link out of the roots
        (_load(server, "a", table["c"][0]), 400, "already loaded"),
        (_load(server, "../x", table["c"][0]), 400, "use 1 to 128 letters"),
        (_unload(server, "x"), 404, "is not loaded"),
    ]
    for r, status, message in refusals:
        assert r.status_code == status and message in r.json()["error"]["message"], r.text
    assert _names(server) == ["a", "b", "c"]
    r = _load(server, "a", table["c"][0], load_inplace=True)  # "a" now serves c's weights
    assert r.status_code == 200 and "replaced" in r.text
    assert _greedy(server, "a", prompt) == _hf_greedy(table["c"][1], prompt)
    assert _unload(server, "c").status_code == 200 and sorted(_names(server)) == ["a", "b"]
    r = requests.post(server.url + "/v1/completions", headers=AUTH, timeout=30,
                      json={"model": "c", "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 404
