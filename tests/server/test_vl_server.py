"""Images in chat on real gunicorn serving a tiny Qwen2.5-VL, in both serve modes (the images cross the engine-core
protocol in the second), with the real `openai` client: the greedy answer `LLM.chat` gives for the same image, remote
images refused unless allowed (then fetched from a local HTTP server, only from allowed hosts), and OpenAI-style 400s
for bad images with nothing left running."""

import base64
import functools
import http.server
import io
import threading
import time

import numpy as np
import pytest
import requests
from PIL import Image

from tests.matrix import sampled
from tests.server.conftest import API_KEY, SERVE_MODES, Server, tiny_engine_env

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
MAX_IMAGE_BYTES = 64 * 1024
MAX_IMAGE_PIXELS = 1000 * 1000
LIMITS = {"JAXLLM_MAX_IMAGE_BYTES": str(MAX_IMAGE_BYTES), "JAXLLM_MAX_IMAGE_PIXELS": str(MAX_IMAGE_PIXELS),
          "JAXLLM_LIMIT_MM_PER_PROMPT": "2"}


def _engine_env(folder, compile_cache_dir) -> dict[str, str]:
    return {**tiny_engine_env(folder, compile_cache_dir), "JAXLLM_MAX_NUM_BATCHED_TOKENS": "32",
            "JAXLLM_NUM_PAGES": "200", "JAXLLM_MAX_MODEL_LEN": "320", "JAXLLM_MAX_NUM_SEQS": "8", **LIMITS}


def _png(width: int, height: int, seed: int = 0, noise: bool = True) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise else \
        np.full((height, width, 3), 128, np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _messages(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What do you see?"}] + [
        {"type": "image_url", "image_url": {"url": u}} for u in urls]}]


@pytest.fixture(scope="module", params=sampled(SERVE_MODES, lambda m: m == "in-process"))
def vl_server(request, tiny_vl_dir, compile_cache_dir, tmp_path_factory):
    env = {"JAXLLM_API_KEY": API_KEY, **({"JAXLLM_API_SERVERS": "2"} if request.param != "in-process" else {})}
    srv = Server(env, tmp_path_factory.mktemp("vl_server") / "server.log",
                 engine_env=_engine_env(tiny_vl_dir[0], compile_cache_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_vl_dir, compile_cache_dir):
    """`LLM` with the server's engine settings (its preset and environment)."""
    import dataclasses

    from jaxllm import LLM
    from server.settings import ServerSettings

    config = ServerSettings.from_env(_engine_env(tiny_vl_dir[0], compile_cache_dir)).engine
    return LLM(config.model, **{k: v for k, v in dataclasses.asdict(config).items() if k != "model"})


def _offline_answer(offline, images: list[bytes]) -> str:
    from jaxllm import SamplingParams

    messages = [{"role": "user", "content": [{"type": "text", "text": "What do you see?"}] + [
        {"type": "image_pil", "image_pil": Image.open(io.BytesIO(d))} for d in images]}]
    (out,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return out.outputs[0].text


def _chat(client, offline, urls):
    return client.chat.completions.create(model=offline.engine.model_name, messages=_messages(*urls), temperature=0,
                                          max_tokens=8, extra_body={"ignore_eos": True})


def test_openai_client_image_gets_the_llm_chat_answer(vl_server, offline):
    import openai

    client = openai.OpenAI(base_url=vl_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    images = [_png(120, 90, seed=1), _png(64, 128, seed=2)]
    one = _chat(client, offline, [_data_url(images[0])])
    assert one.choices[0].message.content == _offline_answer(offline, images[:1])
    image_tokens = one.usage.prompt_tokens - client.chat.completions.create(
        model=offline.engine.model_name, messages=[{"role": "user", "content": "What do you see?"}],
        max_tokens=1).usage.prompt_tokens
    assert image_tokens > 3  # the placeholder became the image's tokens
    two = _chat(client, offline, [_data_url(d) for d in images])
    assert two.choices[0].message.content == _offline_answer(offline, images)
    assert two.usage.prompt_tokens > one.usage.prompt_tokens
    deadline = time.monotonic() + 10  # an engine core's counters reach the API servers with its heartbeat
    while vl_server.metrics()["jaxllm_images_encoded_total"] < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vl_server.metrics()["jaxllm_images_encoded_total"] >= 2  # each image once


@pytest.mark.parametrize("urls, words", [
    (["data:image/png;base64,aGVsbG8gd29ybGQ="], "could not be decoded"),
    (["data:image/png;base64,not base64!"], "base64"),
    ([_data_url(_png(200, 200))], "bytes"),  # ~120 KB of noise, over the 64 KiB limit
    ([_data_url(_png(1200, 1000, noise=False))], "pixels"),  # a few KB, but 1.2 M pixels
    ([_data_url(_png(32, 32, seed=k)) for k in range(3)], "at most 2"),
    (["http://127.0.0.1:9/cat.png"], "remote images"),
    (["file:///etc/passwd"], "scheme"),
])
def test_bad_images_get_openai_errors(vl_server, urls, words):
    since = time.monotonic()
    r = requests.post(vl_server.url + "/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={"messages": _messages(*urls), "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "messages", error
    assert words in error["message"], error
    idle, _, _ = vl_server.wait_idle(since, within=10)
    assert idle


def test_a_text_model_refuses_images(server):
    r = requests.post(server.url + "/v1/chat/completions", headers=HEADERS, timeout=60,
                      json={"messages": _messages(_data_url(_png(32, 32))), "max_tokens": 4})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "does not take images" in error["message"] and error["param"] == "messages", error


@pytest.fixture(scope="module")
def image_host(tmp_path_factory):
    """A local HTTP server with one PNG: (url base, its bytes)."""
    root = tmp_path_factory.mktemp("images")
    data = _png(100, 70, seed=5)
    (root / "cat.png").write_bytes(data)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{httpd.server_address[1]}", data
    httpd.shutdown()


def test_remote_images_fetched_only_from_allowed_hosts(tiny_vl_dir, compile_cache_dir, tmp_path_factory, image_host,
                                                       offline):
    import openai

    host, data = image_host
    srv = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_ALLOW_REMOTE_IMAGES": "true",
                  "JAXLLM_ALLOWED_MEDIA_DOMAINS": "127.0.0.1"}, tmp_path_factory.mktemp("vl_remote") / "server.log",
                 engine_env=_engine_env(tiny_vl_dir[0], compile_cache_dir))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        out = _chat(client, offline, [f"http://{host}/cat.png"])
        assert out.choices[0].message.content == _offline_answer(offline, [data])
        port = host.split(":")[1]
        r = requests.post(srv.url + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
            "messages": _messages(f"http://localhost:{port}/cat.png"), "max_tokens": 4})  # same server, other name
        assert r.status_code == 400 and "does not fetch from" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
