"""The serve modes with real processes and the `openai` client: two API workers sharing an engine-core process
(64 concurrent streams, outputs equal to the single-worker server's; kill -9 of a worker; kill -9 of the core),
data parallel 2 (one engine core per rank, requests spread by load, shared prefixes kept on one rank), and
headless (an engine core started alone, an API server started separately with its address; a wrong secret
refused)."""

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest
import requests

from tests.server.conftest import API_KEY, ENGINE_ENV, ROOT, Server, free_port

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"Write a short line about the number {i}:" for i in range(64)]


def client_of(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def stream_text(client: openai.OpenAI, prompt: str, max_tokens: int = 24) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True)
    return "".join(c.choices[0].text for c in chunks)


def greedy(srv: Server, prompt: str, max_tokens: int = 16) -> str:
    return client_of(srv).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                             temperature=0).choices[0].text


def test_64_streams_over_two_workers_equal_the_single_worker(multi_api_server, server):
    assert len(multi_api_server.api_worker_pids()) == 2 and multi_api_server.core_pid() is not None
    client = client_of(multi_api_server)
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        multi = list(pool.map(lambda p: stream_text(client, p), PROMPTS))
    single_client = client_of(server)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        single = list(pool.map(lambda p: stream_text(single_client, p), PROMPTS))
    assert all(multi) and multi == single
    idle, _, m = multi_api_server.wait_idle(time.monotonic(), 30)
    assert idle, m
    assert m["jaxllm_generation_tokens_total"] >= sum(1 for _ in PROMPTS)  # one engine's counters, not a sum


def _stream(srv: Server, i: int, log: dict) -> None:
    log[i] = {"chunks": 0, "done": False, "error": None}
    try:
        with requests.post(srv.url + "/v1/completions", headers=AUTH, stream=True, timeout=60, json={
                "prompt": f"Tell a long story {i}", "max_tokens": 400, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    log[i]["done"] = True
                elif line.startswith(b"data: "):
                    log[i]["chunks"] += 1
                    if b'"error"' in line:
                        log[i]["error"] = line.decode()
    except requests.RequestException as e:
        log[i]["error"] = type(e).__name__


@pytest.mark.slow
def test_kill_9_of_one_api_worker(multi_api_server):
    srv = multi_api_server
    workers = srv.api_worker_pids()
    log: dict = {}
    threads = [threading.Thread(target=_stream, args=(srv, i, log)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (len(log) == 16 and all(v["chunks"] >= 2 for v in log.values())):
        time.sleep(0.02)
    os.kill(workers[0], signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    completed = [v for v in log.values() if v["done"] and v["error"] is None]
    cut = [v for v in log.values() if not v["done"]]
    assert len(completed) + len(cut) == 16 and completed, log  # the other worker's streams finished
    assert all(v["error"] for v in cut), log  # the killed worker's clients saw their connection end
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (len(srv.api_worker_pids()) == 2 and
                                               workers[0] not in srv.api_worker_pids()):
        time.sleep(0.2)
    assert len(srv.api_worker_pids()) == 2 and workers[0] not in srv.api_worker_pids()  # gunicorn restarted it
    idle, took, m = srv.wait_idle(time.monotonic(), 30)  # the dead worker's requests were aborted in the core
    assert idle, m
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # both workers serve (each new connection, any worker)
        assert all(pool.map(lambda p: greedy(srv, p), PROMPTS[:8]))


@pytest.mark.slow
def test_kill_9_of_the_engine_core(multi_api_server):
    """503 within a second (in-flight requests and /health); the master restarts the core and the workers
    reconnect."""
    srv = multi_api_server
    before = greedy(srv, PROMPTS[0])
    core = srv.core_pid()
    result = {}

    def long_request():
        r = requests.post(srv.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "Count", "max_tokens": 900, "ignore_eos": True})
        result["status"], result["at"] = r.status_code, time.monotonic()

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 30
    while srv.metrics()["jaxllm_num_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    killed = time.monotonic()
    os.kill(core, signal.SIGKILL)
    t.join(30)
    assert result["status"] == 503 and result["at"] - killed < 1.0, result
    health = requests.get(srv.url + "/health", timeout=5)
    assert health.status_code == 503 and time.monotonic() - killed < 1.5
    r = requests.post(srv.url + "/v1/completions", headers=AUTH, timeout=5, json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    srv.wait_healthy(300)
    assert srv.core_pid() not in (None, core)
    for _ in range(4):  # each worker reconnected (connections land on either)
        assert greedy(srv, PROMPTS[0]) == before


@pytest.fixture(scope="module")
def headless_core(tmp_path_factory, compile_cache_dir):
    port = free_port()
    log = tmp_path_factory.mktemp("headless") / "core.log"
    env = {**os.environ, **ENGINE_ENV, "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir, "JAX_PLATFORMS": "cpu",
           "JAXLLM_ENGINE_SECRET": "right-secret"}
    proc = subprocess.Popen([sys.executable, "-m", "server.engine_core", "--headless", "--address",
                             f"tcp://127.0.0.1:{port}"], cwd=ROOT, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    yield f"tcp://127.0.0.1:{port}", log
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()[-3000:]


@pytest.mark.slow
def test_headless_core_and_a_separate_api_server(headless_core, server, tmp_path):
    address, core_log = headless_core
    api = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_ENGINE_ADDRESS": address,
                  "JAXLLM_ENGINE_SECRET": "right-secret"}, tmp_path / "api.log", engine_env={})
    try:
        assert api.core_pid() is None  # this master started no engine
        assert [m.id for m in client_of(api).models.list().data] == [MODEL]
        assert greedy(api, PROMPTS[3]) == greedy(server, PROMPTS[3])
        chat = client_of(api).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=8, temperature=0)
        assert chat.choices[0].message.content
    finally:
        assert api.stop() == 0
    with pytest.raises(RuntimeError, match="refused"):  # the worker fails to boot: gunicorn exits
        Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_ENGINE_ADDRESS": address, "JAXLLM_ENGINE_SECRET": "wrong"},
               tmp_path / "wrong.log", engine_env={})
    assert "refused: wrong secret" in core_log.read_text()


def per_engine(srv: Server, name: str) -> dict[str, float]:
    """{engine rank: value} of a per-engine-core metric."""
    text = requests.get(srv.url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf'^{name}{{[^}}]*engine="(\d+)"[^}}]*}} (\S+)$', text,
                                                               re.MULTILINE)}


def counted(srv: Server, n: int) -> dict[str, float]:
    """Per-rank requests received, once the cores' published counters (a few times a second) show `n` in all."""
    deadline = time.monotonic() + 10
    while sum((routed := per_engine(srv, "jaxllm_engine_requests_total")).values()) < n:
        assert time.monotonic() < deadline, routed
        time.sleep(0.05)
    return routed


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory, compile_cache_dir):
    log = tmp_path_factory.mktemp("gunicorn_dp") / "server.log"
    srv = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir,
                  "JAXLLM_DATA_PARALLEL_SIZE": "2"}, log)
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


@pytest.mark.slow
def test_data_parallel_2_spreads_load_keeps_prefixes_together_and_matches_dp_1(dp_server, server):
    cores = [p for p in dp_server.worker_pids() if b"engine_core" in open(f"/proc/{p}/cmdline", "rb").read()]
    affinities = [os.sched_getaffinity(p) for p in cores]
    assert len(affinities) == 2 and not affinities[0] & affinities[1]  # each rank on its own CPUs
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        dp = list(pool.map(lambda p: greedy(dp_server, p), PROMPTS))
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        single = list(pool.map(lambda p: greedy(server, p), PROMPTS))
    assert dp == single
    routed = counted(dp_server, len(PROMPTS))
    assert set(routed) == {"0", "1"} and min(routed.values()) >= 8, routed  # both ranks took a share
    before = per_engine(dp_server, "jaxllm_engine_prefix_cache_hit_tokens_total")
    prefix = " ".join(f"word{i}" for i in range(100))  # ~290 tokens shared
    for i in range(4):
        greedy(dp_server, f"{prefix} question {i}:", max_tokens=4)
    counted(dp_server, len(PROMPTS) + 4)
    after = per_engine(dp_server, "jaxllm_engine_prefix_cache_hit_tokens_total")
    gained = sorted(after[r] - before.get(r, 0) for r in after)
    assert gained[0] == 0 and gained[1] >= 3 * 256, (before, after)  # one rank, its cache hit three times
