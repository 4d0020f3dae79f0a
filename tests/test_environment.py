"""The process settings read from the environment in one place (`jaxllm.environment`), without JAX: gunicorn's
master reads them."""

import subprocess
import sys

import pytest

from jaxllm.environment import Environment


def test_defaults_and_values():
    assert Environment.read({}) == Environment()
    env = Environment.read({"JAXLLM_API_SERVERS": "3", "JAXLLM_DRAIN_TIMEOUT": "2.5", "JAXLLM_BIND": "127.0.0.1:9",
                            "JAXLLM_STEP_TIMEOUT": "7", "JAXLLM_ENGINE_SECRET": "s", "JAXLLM_LOG_LEVEL": "debug",
                            "JAXLLM_SSL_CERTFILE": "", "UNRELATED": "x"})
    assert (env.api_servers, env.drain_timeout_s, env.bind, env.step_timeout_s, env.engine_secret, env.log_level,
            env.ssl_certfile) == (3, 2.5, "127.0.0.1:9", 7.0, "s", "debug", None)


@pytest.mark.parametrize(("env", "engine_process"), [
    ({}, False), ({"JAXLLM_API_SERVERS": "2"}, True), ({"JAXLLM_DATA_PARALLEL_SIZE": "2"}, True),
    ({"JAXLLM_NUM_HOSTS": "2"}, True), ({"JAXLLM_API_SERVERS": "2", "JAXLLM_ENGINE_ADDRESS": "ipc:///x"}, False)])
def test_who_runs_the_engine_cores(env, engine_process):
    assert Environment.read(env).engine_process is engine_process


@pytest.mark.parametrize(("env", "message"), [
    ({"JAXLLM_API_SERVERS": "0"}, "JAXLLM_API_SERVERS=0: at least 1"),
    ({"JAXLLM_WORKER_TIMEOUT": "soon"}, "JAXLLM_WORKER_TIMEOUT='soon'"),
    ({"JAXLLM_NUM_HOSTS": "2", "JAXLLM_DATA_PARALLEL_SIZE": "2"}, "not supported yet")])
def test_bad_values_are_refused_by_name(env, message):
    with pytest.raises(ValueError, match=message):
        Environment.read(env)


def test_gunicorns_config_reads_them_without_jax():
    code = ("import sys; import server.gunicorn_config as c; "
            "print(c.workers, c.bind, c.timeout, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PATH": "", "JAXLLM_API_SERVERS": "2", "JAXLLM_BIND": "127.0.0.1:7",
                              "JAXLLM_WORKER_TIMEOUT": "9"}).stdout.split()
    assert out == ["2", "127.0.0.1:7", "9", "False"]
