"""``jaxllm serve <hub id>`` in vLLM's three serve modes, the model fetched from a hub on loopback: one API server;
``--api-server-count 2`` (an engine-core process shared by two API workers); ``--headless`` engine cores with an
API server started elsewhere with ``--data-parallel-address``. Each answers the real `openai` client with
``LLM(model=<same id>).chat``'s greedy answer, and refuses a request without the API key."""

import json
import os
import secrets
import subprocess
import sys

import openai
import pytest
import requests

from tests.loading.fake_hub import FakeHub, Repo
from tests.server.conftest import ROOT, Server, free_port

pytestmark = pytest.mark.slow
MODEL = "acme/tiny-chat"
KEY = "serve-key"
MESSAGES = [{"role": "user", "content": "Write two sentences about the sea."}]
# the tiny server's engine (tests/server/conftest.py tiny_engine_env) as vLLM's flags
FLAGS = ["--dtype", "float32", "--max-num-seqs", "16", "--max-num-batched-tokens", "64",
         "--num-gpu-blocks-override", "1100", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def hub(tiny_folder, tmp_path_factory, compile_cache_dir):
    hub = FakeHub({MODEL: Repo({p.name: p.read_bytes() for p in tiny_folder.iterdir() if p.is_file()})})
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXLLM_", "HF_"))}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path_factory.mktemp("hf_cache")),
               HF_HUB_DISABLE_PROGRESS_BARS="1", JAXLLM_ATTN_IMPL="reference", JAXLLM_MATMUL_IMPL="reference",
               JAXLLM_COMPILATION_CACHE_DIR=compile_cache_dir, JAX_PLATFORMS="cpu")
    hub.env = env
    yield hub
    hub.close()


@pytest.fixture(scope="module")
def expected(hub) -> str:
    """LLM(model=<the hub id>).chat's greedy answer, in a process of its own (the hub's variables)."""
    code = ("import json, sys\nfrom jaxllm import LLM, SamplingParams\n"
            f"llm = LLM(model={MODEL!r}, dtype='float32', max_num_seqs=16, max_num_batched_tokens=64, num_pages=1100,"
            " max_model_len=1024)\n"
            f"out = llm.chat({MESSAGES!r}, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)\n"
            "print(json.dumps(out[0].outputs[0].text))\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=hub.env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def serve(env: dict[str, str], log, *flags: str) -> Server:
    """``jaxllm serve MODEL`` listening where the test's Server puts it (JAXLLM_BIND: a free loopback port)."""
    argv = [sys.executable, "-m", "jaxllm", "serve", MODEL, *FLAGS, "--api-key", KEY, *flags]
    return Server({}, log, engine_env=env, argv=argv)


def check(server: Server, expected: str) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [MODEL]  # served under the name it was asked by
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12)
    assert reply.choices[0].message.content == expected
    assert requests.get(server.url + "/v1/models", timeout=10).status_code == 401  # no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.parametrize("mode", ["one API server", "--api-server-count 2"])
def test_serve_a_hub_id(hub, expected, tmp_path, mode):
    flags = ["--api-server-count", "2"] if mode != "one API server" else []
    server = serve(hub.env, tmp_path / "serve.log", *flags)
    try:
        check(server, expected)
        if flags:
            assert server.core_pid() is not None and len(server.api_worker_pids()) == 2
        assert "model acme/tiny-chat: " in (tmp_path / "serve.log").read_text()  # where the model came from
    finally:
        assert server.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]


def test_headless_engine_cores_and_an_api_server_elsewhere(hub, expected, tmp_path):
    rpc = free_port()
    env = dict(hub.env, JAXLLM_ENGINE_SECRET=secrets.token_hex(16))
    with open(tmp_path / "core.log", "w") as log:
        core = subprocess.Popen([sys.executable, "-m", "jaxllm", "serve", MODEL, *FLAGS, "--headless",
                                 "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        server = serve(env, tmp_path / "api.log", "--data-parallel-address", "127.0.0.1",
                       "--data-parallel-rpc-port", str(rpc))
        try:
            check(server, expected)
            assert server.core_pid() is None  # this API server started no engine
        finally:
            assert server.stop() == 0, (tmp_path / "api.log").read_text()[-3000:]
    finally:
        core.terminate()
        assert core.wait(60) == 0, (tmp_path / "core.log").read_text()[-3000:]
