"""Concurrency, client disconnects and graceful shutdown against real gunicorn processes."""

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from tests.server.conftest import API_KEY, Server

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOPICS = ["the sea", "a city", "a forest", "the moon", "a robot", "music", "rain", "a library"]


def stream_chat(url, i, max_tokens=24, headers=AUTH):
    """Returns [(arrival time, content)] and the finish reason."""
    body = {"messages": [{"role": "user", "content": f"Write two sentences about {TOPICS[i % len(TOPICS)]}."}],
            "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True, "ignore_eos": True}
    events, finish = [], None
    with requests.post(url + "/v1/chat/completions", json=body, headers=headers, stream=True, timeout=300) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = chunk["choices"][0]
            if choice["delta"].get("content"):
                events.append((time.monotonic(), choice["delta"]["content"]))
            finish = choice["finish_reason"] or finish
    return events, finish


def test_64_concurrent_streams_interleave_and_health_stays_fast(server):
    health_latencies, stop = [], threading.Event()

    def poll_health():
        while not stop.is_set():
            t = time.monotonic()
            assert requests.get(server.url + "/health", timeout=5).status_code == 200
            health_latencies.append(time.monotonic() - t)
            time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda i: stream_chat(server.url, i), range(64)))
    finally:
        stop.set()
        poller.join()
    assert all(finish == "length" for _, finish in results)
    all_events = sorted((t, i) for i, (events, _) in enumerate(results) for t, _ in events)
    for i, (events, _) in enumerate(results):
        assert len(events) >= 10
        first, last = events[0][0], events[-1][0]
        assert last - first > 0.2  # streamed over time, not delivered in one burst
        others = {j for t, j in all_events if first < t < last and j != i}
        assert len(others) >= 8  # other requests' tokens arrived in between
    print(f"\n/health during the load: {len(health_latencies)} polls, max {max(health_latencies) * 1e3:.1f} ms, "
          f"median {sorted(health_latencies)[len(health_latencies) // 2] * 1e3:.1f} ms")
    assert max(health_latencies) < 0.1


def test_disconnected_clients_free_their_pages_within_a_second(server):
    def start_and_drop(i):
        body = {"messages": [{"role": "user", "content": f"Tell a long story about {TOPICS[i % 8]}."}],
                "max_tokens": 400, "ignore_eos": True, "stream": True}
        r = requests.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, stream=True, timeout=60)
        lines = r.iter_lines()
        got = 0
        while got < 4:
            if next(lines).startswith(b"data: "):
                got += 1
        r.raw._fp.fp.raw._sock.shutdown(2)  # drop the connection mid-stream
        r.close()

    with ThreadPoolExecutor(10) as pool:
        list(pool.map(start_and_drop, range(10)))
    dropped = time.monotonic()
    while True:
        m = server.metrics()
        idle = m["jaxllm_num_requests_running"] == 0 and m["jaxllm_kv_cache_free_pages"] == m["jaxllm_kv_cache_pages"]
        if idle or time.monotonic() - dropped > 1.0:
            break
        time.sleep(0.05)
    print(f"\nengine idle {time.monotonic() - dropped:.2f} s after the last of 10 clients dropped")
    assert idle, m


def test_sigterm_drains_in_flight_requests(tmp_path, compile_cache_dir):
    srv = Server({"JAXLLM_MAX_NUM_SEQS": "1", "JAXLLM_MAX_NUM_BATCHED_TOKENS": "16",
                  "JAXLLM_MAX_WAITING_REQUESTS": "1", "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir},
                 tmp_path / "server.log")
    result = {}

    def client():
        result["events"], result["finish"] = stream_chat(srv.url, 0, max_tokens=60, headers={})

    t = threading.Thread(target=client)
    t.start()
    time.sleep(1.5)  # the request is streaming
    code = srv.stop(timeout=90)
    t.join(10)
    assert result["finish"] == "length" and len(result["events"]) > 30  # finished, not cut off
    assert code == 0
