import pytest

from tests.server.conftest import API_KEY, Server, tiny_engine_env


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_folder, compile_cache_dir):
    """gunicorn on the tiny Llama, the API key required: what the client commands (chat, complete, bench) talk to."""
    srv = Server({"JAXLLM_API_KEY": API_KEY}, tmp_path_factory.mktemp("cli_server") / "server.log",
                 engine_env=tiny_engine_env(tiny_folder, compile_cache_dir))
    yield srv
    srv.stop()
