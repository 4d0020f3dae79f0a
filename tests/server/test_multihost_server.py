"""gunicorn serving a model spread over two processes (2 x 2 host devices, tensor parallel 4): the master starts
rank 0's engine core (JAXLLM_NUM_HOSTS=2), rank 1 is a headless follower. The `openai` client streams through it;
killing rank 1 mid-request fails rank 0's requests with 503 and makes /health 503, and nothing hangs."""

import concurrent.futures
import os
import shutil
import signal
import time

import openai
import pytest
import requests

from tests.engine.test_multihost import coordinator_port, multihost_env, start_follower
from tests.server.conftest import API_KEY, Server

pytestmark = pytest.mark.slow  # two hosts' processes (~50 s)


@pytest.fixture(scope="module")
def job(tiny_model_dir, compile_cache_dir, tmp_path_factory):
    from tests.tiny_models import add_tiny_tokenizer

    src, _ = tiny_model_dir("qwen2_tp")
    d = tmp_path_factory.mktemp("multihost_server")
    folder = d / "qwen2_tp"
    shutil.copytree(src, folder)
    add_tiny_tokenizer(folder)
    env = multihost_env(folder, compile_cache_dir, coordinator_port(), JAXLLM_MAX_MODEL_LEN="2048",
                        JAXLLM_NUM_PAGES="1024")
    follower = start_follower(env, d / "rank1.log")
    try:
        srv = Server({"JAXLLM_API_KEY": API_KEY}, d / "server.log", engine_env=env)
    except Exception:
        follower.kill()
        raise
    yield srv, follower, folder.name
    follower.kill()
    srv.stop()


def test_16_streams_with_the_model_over_two_processes(job):
    srv, follower, model = job
    assert srv.core_pid() is not None and follower.poll() is None
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    def stream(i: int) -> tuple[str, str | None]:
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count slowly: {i}"}], max_tokens=24,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, finish = "", None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, range(16)))
    assert all(text and finish == "length" for text, finish in results), results


def test_killing_rank_1_fails_requests_with_503_and_health_503(job):
    srv, follower, model = job
    core = srv.core_pid()
    assert core is not None and srv.healthy()

    def long_request(i: int) -> tuple[int, float]:
        r = requests.post(srv.url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {API_KEY}"},
                          json={"model": model, "prompt": f"Tell a long story {i}", "max_tokens": 2000,
                                "ignore_eos": True})
        return r.status_code, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(long_request, i) for i in range(4)]
        time.sleep(1.5)
        assert not any(f.done() for f in futures)  # mid-request
        killed_at = time.monotonic()
        os.kill(follower.pid, signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
    assert all(status == 503 for status, _ in results), results
    assert max(t for _, t in results) - killed_at < 30
    deadline = killed_at + 30
    while srv.healthy() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert requests.get(srv.url + "/health", timeout=5).status_code == 503
    # Rank 0's engine core did not hang in a collective or at its exit: it ended (the supervisor starts a fresh
    # one, which waits for a rank 1 to join), and the API server kept answering.
    while srv.core_pid() == core and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.core_pid() != core, "rank 0's engine core still runs 30 s after rank 1 died"
    assert srv.proc.poll() is None
