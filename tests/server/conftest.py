"""Real gunicorn processes serving the embedded SmolLM2 on 127.0.0.1."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from benchmarks.soak import parse_metrics
from tests.conftest import ENGINE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
ORIGIN = "https://app.example"  # the one origin CORS allows on tiny_server
ENGINE_ENV = {f"JAXLLM_{k.upper()}": str(v) for k, v in ENGINE_OPTIONS.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """gunicorn (./gunicorn.conf.py: one gevent worker) on a free loopback port; `verify`: the CA bundle when
    the server speaks TLS."""

    def __init__(self, env: dict[str, str], log: Path, *, app: str = "server.app:app", engine_env: dict | None = None,
                 verify: str | None = None, argv: list[str] | None = None):
        """argv: the command that starts the server instead of ``gunicorn <app>`` (e.g. ``jaxllm serve``); it
        listens where JAXLLM_BIND says."""
        self.port = free_port()
        self.verify = verify
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log = log
        full_env = {**os.environ, **(ENGINE_ENV if engine_env is None else engine_env), **env,
                    "JAXLLM_BIND": f"127.0.0.1:{self.port}",
                    "JAX_PLATFORMS": "cpu"}  # XLA_FLAGS as in the tests: compiled buckets are shared
        started = time.monotonic()
        self.proc = subprocess.Popen(argv or [sys.executable, "-m", "gunicorn", app], cwd=ROOT, env=full_env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        self.wait_healthy(400)
        self.startup_s = time.monotonic() - started

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=1, verify=self.verify or True).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{self.log.read_text()[-3000:]}")
            if self.healthy():
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"gunicorn did not become healthy:\n{self.log.read_text()[-3000:]}")

    def worker_pids(self) -> list[int]:
        """The gunicorn master's children: its workers."""
        children = []  # per thread: the engine-core supervisor's thread starts the core
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            try:
                children += (task / "children").read_text().split()
            except FileNotFoundError:
                pass
        return sorted(int(c) for c in children)

    def core_pid(self) -> int | None:
        """The engine-core process this master started (several-API-workers mode), if any."""
        for pid in self.worker_pids():
            try:
                if b"server.engine_core" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except FileNotFoundError:
                pass
        return None

    def api_worker_pids(self) -> list[int]:
        core = self.core_pid()
        return [p for p in self.worker_pids() if p != core]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(requests.get(self.url + "/metrics", timeout=5, verify=self.verify or True).text)

    def wait_idle(self, since: float, within: float) -> tuple[bool, float, dict]:
        """Polls /metrics until nothing runs and every KV page is free, or `within` seconds after `since`:
        (idle, seconds after `since`, the last metrics)."""
        while True:
            m = self.metrics()
            idle = m["jaxllm_num_requests_running"] == 0 and \
                m["jaxllm_kv_cache_free_pages"] == m["jaxllm_kv_cache_pages"]
            if idle or time.monotonic() - since > within:
                return idle, time.monotonic() - since, m
            time.sleep(0.05)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server(tmp_path_factory, compile_cache_dir):
    log = tmp_path_factory.mktemp("gunicorn") / "server.log"
    srv = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir,
                  "JAXLLM_MAX_BODY_BYTES": str(1 << 20)}, log)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def multi_api_server(tmp_path_factory, compile_cache_dir):
    """The same engine as `server`, in an engine-core process shared by two gevent API workers."""
    log = tmp_path_factory.mktemp("gunicorn_multi") / "server.log"
    srv = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir,
                  "JAXLLM_MAX_BODY_BYTES": str(1 << 20), "JAXLLM_API_SERVERS": "2"}, log)
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


def tiny_engine_env(folder: Path, compile_cache_dir: str) -> dict[str, str]:
    return {"JAXLLM_MODEL": str(folder), "JAXLLM_DTYPE": "float32", "JAXLLM_ATTN_IMPL": "reference",
            "JAXLLM_MATMUL_IMPL": "reference", "JAXLLM_MAX_NUM_SEQS": "16", "JAXLLM_MAX_NUM_BATCHED_TOKENS": "64",
            "JAXLLM_NUM_PAGES": "1100", "JAXLLM_MAX_MODEL_LEN": "1024",
            "JAXLLM_COMPILATION_CACHE_DIR": compile_cache_dir}


SERVE_MODES = ["in-process", "2-api-workers"]


def serve_mode_fixtures():
    """`server` and `client` fixtures for a module whose tests run in both serve modes on this host (the engine
    in the worker; two API workers sharing an engine-core process): `server, client = serve_mode_fixtures()`."""

    @pytest.fixture(scope="module", params=SERVE_MODES)
    def server(request):
        return request.getfixturevalue("server" if request.param == "in-process" else "multi_api_server")

    @pytest.fixture(scope="module")
    def client(server):
        import openai

        return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

    return server, client


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tls_ca():
    import trustme

    return trustme.CA()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory, tiny_folder, compile_cache_dir, tls_ca):
    """HTTPS (a trustme certificate), CORS for one origin, an API key, and the device-failure hook."""
    d = tmp_path_factory.mktemp("tiny_server")
    cert = tls_ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(d / "key.pem")
    cert.cert_chain_pems[0].write_to_path(d / "cert.pem")
    tls_ca.cert_pem.write_to_path(d / "ca.pem")
    srv = Server({"JAXLLM_API_KEY": API_KEY, "JAXLLM_SSL_CERTFILE": str(d / "cert.pem"),
                  "JAXLLM_SSL_KEYFILE": str(d / "key.pem"), "JAXLLM_ALLOWED_ORIGINS": ORIGIN},
                 d / "server.log", app="tests.server.faulty_app:app",
                 engine_env=tiny_engine_env(tiny_folder, compile_cache_dir), verify=str(d / "ca.pem"))
    yield srv
    srv.stop()
