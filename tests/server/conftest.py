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

from tests.conftest import ENGINE_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "test-key"
ENGINE_ENV = {f"JAXLLM_{k.upper()}": str(v) for k, v in ENGINE_OPTIONS.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, env: dict[str, str], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        full_env = {**os.environ, **ENGINE_ENV, **env, "JAXLLM_BIND": f"127.0.0.1:{self.port}",
                    "JAX_PLATFORMS": "cpu"}  # XLA_FLAGS as in the tests: compiled buckets are shared
        self.proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "server.app:app"], cwd=ROOT, env=full_env,
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"gunicorn did not become healthy:\n{log.read_text()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        values = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name.split("{")[0]] = float(value)
        return values

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
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
