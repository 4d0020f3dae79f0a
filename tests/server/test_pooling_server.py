"""/v1/embeddings and /pooling on real gunicorn, in both serve modes, with the real `openai` client: the vectors
`LLM.embed` computes, in OpenAI's shapes (float and base64), and OpenAI-style errors for bad input."""

import base64

import numpy as np
import pytest
import requests

from jaxllm import PoolingParams
from tests.matrix import sampled
from tests.server.conftest import API_KEY, SERVE_MODES, Server, tiny_engine_env
from tests.tiny_models import TOKENIZER_CORPUS

TEXTS = [TOKENIZER_CORPUS[0], TOKENIZER_CORPUS[1] * 3, TOKENIZER_CORPUS[4] * 2]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def folder(tiny_embedding_dir):
    return tiny_embedding_dir("last")


@pytest.fixture(scope="module", params=sampled(SERVE_MODES, lambda m: m == "in-process"))
def embed_server(request, folder, compile_cache_dir, tmp_path_factory):
    env = {"JAXLLM_API_KEY": API_KEY, **({"JAXLLM_API_SERVERS": "2"} if request.param != "in-process" else {})}
    srv = Server(env, tmp_path_factory.mktemp("embed_server") / "server.log",
                 engine_env=tiny_engine_env(folder, compile_cache_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(folder, compile_cache_dir):
    """`LLM.embed` with the server's engine settings (its preset and environment)."""
    import dataclasses

    from jaxllm import LLM
    from server.settings import ServerSettings

    config = ServerSettings.from_env(tiny_engine_env(folder, compile_cache_dir)).engine
    return LLM(config.model, **{k: v for k, v in dataclasses.asdict(config).items() if k != "model"})


def test_openai_client_gets_the_vectors_llm_embed_computes(embed_server, offline):
    import openai

    client = openai.OpenAI(base_url=embed_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    want = np.stack([o.outputs.data for o in offline.embed(TEXTS, use_tqdm=False)])
    floats = client.embeddings.create(model=offline.engine.model_name, input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2] and floats.object == "list"
    np.testing.assert_allclose(np.array([d.embedding for d in floats.data]), want, atol=1e-6)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(
        len(offline.get_tokenizer().encode(t)) for t in TEXTS)
    model = offline.engine.model_name
    encoded = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")
    vectors = np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in encoded.data])
    np.testing.assert_allclose(vectors, want, atol=1e-6)
    # The client's default: it asks for base64 and decodes it itself.
    default = client.embeddings.create(model=model, input=TEXTS[0], dimensions=8)
    short = offline.embed(TEXTS[0], PoolingParams(dimensions=8), use_tqdm=False)[0]
    np.testing.assert_allclose(default.data[0].embedding, short.outputs.data, atol=1e-6)
    ids = offline.get_tokenizer().encode(TEXTS[1])
    by_ids = client.embeddings.create(model=model, input=[ids, ids[:5]])
    np.testing.assert_allclose(by_ids.data[0].embedding, want[1], atol=1e-6)


def test_pooling_route(embed_server, offline):
    r = requests.post(embed_server.url + "/pooling", headers=HEADERS, json={"input": TEXTS[:2]}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    want = [o.outputs.data for o in offline.embed(TEXTS[:2], use_tqdm=False)]
    for d, w in zip(body["data"], want, strict=True):
        np.testing.assert_allclose(d["data"], w, atol=1e-6)


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": ["a text", 17]}, "input"),
    ({"input": [[1, 2], "a text"]}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "a text", "dimensions": 65}, "dimensions"),
    ({"input": "a text", "dimensions": 0}, "dimensions"),
    ({"input": "a text", "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[5000]]}, "prompt"),
    ({"input": "a text " * 600}, "input"),
])
def test_bad_input_gets_an_openai_error(embed_server, body, param):
    r = requests.post(embed_server.url + "/v1/embeddings", headers=HEADERS, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_routes_need_the_api_key(embed_server):
    for path in ("/v1/embeddings", "/pooling"):
        r = requests.post(embed_server.url + path, json={"input": "a text"}, timeout=30)
        assert r.status_code == 401


def test_a_generation_model_refuses_to_embed(server):
    r = requests.post(server.url + "/v1/embeddings", headers=HEADERS, json={"input": "a text"}, timeout=60)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "does not produce embeddings" in error["message"] and error["param"] == "model"


@pytest.fixture(scope="module")
def rerank_server(tiny_encoder_dir, compile_cache_dir, tmp_path_factory):
    env = {**tiny_engine_env(tiny_encoder_dir("bert", "classifier"), compile_cache_dir),
           "JAXLLM_MAX_NUM_BATCHED_TOKENS": "128", "JAXLLM_MAX_MODEL_LEN": "128"}
    srv = Server({"JAXLLM_API_KEY": API_KEY}, tmp_path_factory.mktemp("rerank_server") / "server.log", engine_env=env)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_score_and_rerank_routes(rerank_server, tiny_encoder_dir):
    from sentence_transformers import CrossEncoder

    query, docs = "What is the capital of France?", TOKENIZER_CORPUS
    want = CrossEncoder(str(tiny_encoder_dir("bert", "classifier")), device="cpu").predict([(query, d) for d in docs])
    r = requests.post(rerank_server.url + "/score", headers=HEADERS, json={"text_1": query, "text_2": docs},
                      timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(docs)))
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-4)
    assert body["usage"]["prompt_tokens"] > 0
    for path in ("/rerank", "/v1/rerank"):
        r = requests.post(rerank_server.url + path, headers=HEADERS, timeout=60,
                          json={"query": query, "documents": [docs[0], {"text": docs[1]}, *docs[2:]], "top_n": 3})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable")[:3])
        assert results[0]["document"]["text"] == docs[results[0]["index"]]
        np.testing.assert_allclose(results[0]["relevance_score"], want.max(), atol=1e-4)
    r = requests.post(rerank_server.url + "/rerank", headers=HEADERS, timeout=60,
                      json={"query": query, "documents": docs, "return_documents": False})
    assert len(r.json()["results"]) == len(docs) and "document" not in r.json()["results"][0]


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": " ", "documents": ["b"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": 0}, "top_n"),
    ("/rerank", {"query": "a " * 300, "documents": ["b"]}, "documents"),
    ("/v1/embeddings", {"input": "a text"}, "model"),
    ("/v1/completions", {"prompt": "a text", "max_tokens": 2}, "model"),
])
@pytest.mark.slow
def test_rerank_server_refuses_bad_input(rerank_server, path, body, param):
    r = requests.post(rerank_server.url + path, headers=HEADERS, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
