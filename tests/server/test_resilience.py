"""Faults against real gunicorn processes on the tiny model (starts in seconds): the worker killed with -9, the
engine dying under load, TLS with the official client, CORS, abandoned non-streaming requests."""

import json
import os
import signal
import socket
import threading
import time

import pytest
import requests

from tests.server.conftest import API_KEY, ORIGIN, Server
from tests.server.faulty_app import DEVICE_FAILURE

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def long_stream(srv: Server, i: int, log: dict, max_tokens: int = 900):
    """Streams one long completion; records the chunks seen and how the stream ended."""
    body = {"prompt": f"Tell a long story about the sea {i}", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    log[i] = {"chunks": 0, "done": False, "error": None}
    try:
        with requests.post(srv.url + "/v1/completions", json=body, headers=AUTH, stream=True, timeout=30,
                           verify=srv.verify) as r:
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    log[i]["done"] = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        log[i]["error"] = chunk["error"]
                    log[i]["chunks"] += 1
    except requests.RequestException as e:
        log[i]["error"] = type(e).__name__


def start_streams(srv: Server, n: int) -> tuple[list[threading.Thread], dict]:
    log: dict = {}
    threads = [threading.Thread(target=long_stream, args=(srv, i, log)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (len(log) == n and all(v["chunks"] >= 3 for v in log.values())):
        time.sleep(0.02)
    assert len(log) == n and all(v["chunks"] >= 3 for v in log.values()), log
    return threads, log


def wait_new_worker(srv: Server, old: list[int], bound_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < bound_s:
        if srv.healthy() and srv.worker_pids() and srv.worker_pids() != old:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"no healthy new worker within {bound_s:.0f} s:\n{srv.log.read_text()[-3000:]}")


def test_openai_client_over_tls(tiny_server):
    import ssl

    import openai

    client = openai.OpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0, http_client=openai.
                           DefaultHttpxClient(verify=ssl.create_default_context(cafile=tiny_server.verify)))
    out = client.completions.create(model="llama", prompt="The quick brown fox", max_tokens=5)
    assert out.usage.completion_tokens == 5
    chat = client.chat.completions.create(model="llama", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, stream=True)
    assert sum(1 for _ in chat) >= 2
    with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust the CA is refused
        requests.get(tiny_server.url + "/health", timeout=5)
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP is not served on the TLS port
        requests.get(tiny_server.url.replace("https", "http") + "/health", timeout=5)


def test_cors_allows_the_configured_origin_only(tiny_server):
    url, verify = tiny_server.url, tiny_server.verify
    pre = requests.options(url + "/v1/chat/completions", verify=verify, timeout=5, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "authorization" in pre.headers["Access-Control-Allow-Headers"].lower()
    r = requests.get(url + "/v1/models", headers={**AUTH, "Origin": ORIGIN}, verify=verify, timeout=5)
    assert r.headers["Access-Control-Allow-Origin"] == ORIGIN
    other = requests.get(url + "/v1/models", headers={**AUTH, "Origin": "https://evil.example"}, verify=verify,
                         timeout=5)
    assert "Access-Control-Allow-Origin" not in other.headers
    assert requests.get(url + "/v1/models", headers={"Origin": ORIGIN}, verify=verify, timeout=5).status_code == 401


def test_engine_death_gives_503_and_a_fresh_worker(tiny_server):
    threads, log = start_streams(tiny_server, 4)
    old = tiny_server.worker_pids()
    r = requests.post(tiny_server.url + "/v1/completions", headers=AUTH, verify=tiny_server.verify, timeout=30,
                      json={"prompt": DEVICE_FAILURE, "max_tokens": 4})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    for v in log.values():  # the in-flight streams got an error event (or a cut connection), not a hang
        assert not v["done"] and v["error"] is not None, v
    took = wait_new_worker(tiny_server, old, bound_s=tiny_server.startup_s + 30)
    print(f"\nfresh worker healthy {took:.1f} s after the engine died (first start {tiny_server.startup_s:.1f} s)")
    r = requests.post(tiny_server.url + "/v1/completions", headers=AUTH, verify=tiny_server.verify, timeout=30,
                      json={"prompt": "The quick brown fox", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_kill_9_of_the_worker_under_16_streams(tiny_server):
    threads, log = start_streams(tiny_server, 16)
    old = tiny_server.worker_pids()
    os.kill(old[0], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(max(0.1, 10 - (time.monotonic() - killed)))
    assert not any(t.is_alive() for t in threads), "a client hung after the worker died"
    for v in log.values():
        assert not v["done"] and v["error"] is not None, v  # a connection error, not a silently short answer
    took = wait_new_worker(tiny_server, old, bound_s=tiny_server.startup_s + 5)  # a warm start, at most a cold one
    print(f"\nfresh worker healthy {took:.1f} s after kill -9 (first start {tiny_server.startup_s:.1f} s)")
    r = requests.post(tiny_server.url + "/v1/chat/completions", headers=AUTH, verify=tiny_server.verify, timeout=30,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_abandoned_non_streaming_request_is_aborted(server):
    """A client that gives up on a non-streaming request (closes its socket) stops its generation within about
    a second, instead of the engine generating 600 tokens for nobody."""
    body = json.dumps({"prompt": "Count slowly:", "max_tokens": 600, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode() +
                 b"\r\n\r\n" + body)
    deadline = time.monotonic() + 30
    while server.metrics()["jaxllm_num_requests_running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    sock.close()
    idle, took, m = server.wait_idle(since=time.monotonic(), within=1.5)
    print(f"\nengine idle {took:.2f} s after the client closed its connection")
    assert idle, m
