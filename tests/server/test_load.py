"""Concurrency, client disconnects and graceful shutdown against real gunicorn processes."""

import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.server.conftest import API_KEY, Server, parse_metrics, serve_mode_fixtures

server, client = serve_mode_fixtures()  # each test in both serve modes

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.slow
def test_64_concurrent_streams_interleave_and_health_stays_fast(server):
    poller = subprocess.Popen([sys.executable, "-m", "tests.server.health_poller", server.url],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert poller.stdout.readline().strip() == "ready"
    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda i: stream_chat(server.url, i), range(64)))
    finally:
        polled = json.loads(poller.communicate(timeout=60)[0])  # closing its stdin stops it
    health_latencies, failures = polled["latencies"], polled["failures"]
    assert not failures, failures
    assert all(finish == "length" for _, finish in results)
    all_events = sorted((t, i) for i, (events, _) in enumerate(results) for t, _ in events)
    for i, (events, _) in enumerate(results):
        assert len(events) >= 10
        first, last = events[0][0], events[-1][0]
        assert last - first > 0.2  # streamed over time, not delivered in one burst
        others = {j for t, j in all_events if first < t < last and j != i}
        assert len(others) >= 8  # other requests' tokens arrived in between
    lat = sorted(health_latencies)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    print(f"\n/health during the load: {len(lat)} polls, max {lat[-1] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, "
          f"median {lat[len(lat) // 2] * 1e3:.1f} ms")
    # p99 as the issue states it. The maximum may be a poll queued behind the burst of 64 arriving requests (each
    # parsed and tokenized on the one hub thread while the engine thread starts their prefill): up to 0.9 s was seen
    # on a 2-core CI host shared with the 64 client threads; a longer wait would be a stall.
    assert p99 < 0.1 and lat[-1] < 2.0


@pytest.mark.slow
def test_metrics_hammered_by_8_clients_during_64_streams(server):
    """Scrapes read the snapshot the engine thread publishes between steps, never its live structures: 8 clients
    scraping as fast as they can during a 64-stream load see no error and consistent values."""
    stop, scrapes, failures = threading.Event(), [], []

    def scrape():
        with requests.Session() as s:
            while not stop.is_set():
                try:
                    r = s.get(server.url + "/metrics", timeout=10)
                    m = parse_metrics(r.text)
                    if r.status_code != 200 or not 0 <= m["jaxllm_kv_cache_free_pages"] <= m["jaxllm_kv_cache_pages"]:
                        failures.append((r.status_code, r.text[:200]))
                    scrapes.append(m)
                except Exception as e:  # collected; asserted in the test's thread
                    failures.append(repr(e))

    scrapers = [threading.Thread(target=scrape) for _ in range(8)]
    for t in scrapers:
        t.start()
    try:
        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(lambda i: stream_chat(server.url, i, max_tokens=16), range(64)))
    finally:
        stop.set()
        for t in scrapers:
            t.join()
    print(f"\n{len(scrapes)} scrapes of /metrics during 64 streams, max running seen "
          f"{max(m['jaxllm_num_requests_running'] for m in scrapes):.0f}")
    assert not failures, failures[:5]
    assert all(finish == "length" for _, finish in results)
    assert len(scrapes) >= 80 and max(m["jaxllm_num_requests_running"] for m in scrapes) > 1


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
    idle, took, m = server.wait_idle(since=time.monotonic(), within=1.0)
    print(f"\nengine idle {took:.2f} s after the last of 10 clients dropped")
    assert idle, m


@pytest.mark.slow
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


def test_long_prompts_are_tokenized_off_the_hub_thread(server):
    """Four 300 KB texts being tokenized (~0.25 s each, under the size that is refused outright) do not stall
    /health: tokenizing runs on worker threads and releases the GIL."""
    text = "The quick brown fox jumps over the lazy dog. " * 6_700
    results, latencies = [], []

    def tokenize(_):
        r = requests.post(server.url + "/tokenize", json={"prompt": text}, headers=AUTH, timeout=60)
        results.append((r.status_code, r.json().get("count")))

    t = time.monotonic()
    tokenize(None)
    alone = time.monotonic() - t  # what a poll would wait behind each text if the hub tokenized it
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(tokenize, i) for i in range(4)]
        while not all(f.done() for f in futures):
            t = time.monotonic()
            assert requests.get(server.url + "/health", timeout=5).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.01)
    print(f"\n/health while 4 x {len(text) // 1000} KB texts were tokenized ({alone * 1e3:.0f} ms alone): "
          f"{len(latencies)} polls, median {statistics.median(latencies) * 1e3:.1f} ms, "
          f"max {max(latencies) * 1e3:.1f} ms")
    assert [s for s, _ in results] == [200] * 5 and all(c > 60_000 for _, c in results)
    # Tokenizing on the hub would leave a few polls, each waiting out whole texts. Here polls are quick; on two
    # cores shared with four tokenizing threads, the server's other processes and this test, the OS may still
    # hold back the hub for a slice now and then: two slow polls are allowed.
    slowest = sorted(latencies)
    assert len(latencies) >= 5 and statistics.median(latencies) < alone / 4 and slowest[-3] < alone / 2, \
        (alone, slowest[-3:])
