"""gunicorn settings and hooks for the API server: ``gunicorn server.app:app`` (via ./gunicorn.conf.py) and
``jaxllm serve`` read them from here, from the environment (JAXLLM_*). Three ways to run (README, "Serve modes"):

- default: one gevent worker holding the engine in its own OS thread (each worker would load its own model and
  KV cache, so there is one);
- JAXLLM_API_SERVERS=N (N > 1): N gevent workers (HTTP, JSON, tokenization, detokenized output assembly, SSE)
  sharing one engine-core process (`python -m server.engine_core`) that this master starts on a private IPC
  address with a fresh shared secret, and restarts if it dies (workers answer 503 meanwhile, then reconnect);
- JAXLLM_DATA_PARALLEL_SIZE=D (D > 1): D engine-core processes, each on its share of the devices, that the
  JAXLLM_API_SERVERS workers (default 1) share, each request sent to a rank by load and prefix affinity;
- JAXLLM_NUM_HOSTS=H (H > 1, with JAXLLM_COORDINATOR_ADDRESS): the model spans H hosts; this master starts rank
  0's engine core, and each other host runs `python -m server.engine_core --headless --host-rank R ...`;
- JAXLLM_ENGINE_ADDRESS (+ JAXLLM_ENGINE_SECRET): N = JAXLLM_API_SERVERS workers (default 1) using engine
  cores started elsewhere (headless; comma-separated addresses, one per data-parallel rank); this master starts
  none.

No preload: JAX must not start in the master (it never imports it).

With several workers, request latencies (histograms each worker observes) go through prometheus_client's
multiprocess mode: a fresh directory of per-process files that every worker's /metrics sums, so a scrape counts
every worker's requests whichever worker answers it. A PROMETHEUS_MULTIPROC_DIR set by the operator is used as is.
"""

import os
import shutil
import tempfile

from jaxllm.environment import Environment

_env = Environment.read()
bind = _env.bind
data_parallel_size = _env.data_parallel_size
engine_process = _env.engine_process  # this master runs the engine cores
workers = _env.api_servers
worker_class = "gevent"
worker_connections = 1000
# Loading the model and compiling every bucket happens before the worker (or the engine core) serves.
timeout = _env.worker_timeout_s
graceful_timeout = int(_env.drain_timeout_s) + 5
keepalive = 5
accesslog = None  # the app logs one line per request with token counts
loglevel = _env.log_level
# TLS: gunicorn terminates it itself when both files are given.
certfile = _env.ssl_certfile
keyfile = _env.ssl_keyfile
_core = None
_metrics_dir = None


def on_starting(server):
    """Several API workers or data parallelism: start the engine cores before any worker is forked; several
    workers: their shared metrics directory (before any of them imports prometheus_client)."""
    global _core, _metrics_dir
    if workers > 1 and not (os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")):
        _metrics_dir = tempfile.mkdtemp(prefix="jaxllm-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir
    if engine_process:
        from server.core_supervisor import CoreSupervisor

        _core = CoreSupervisor(server.log, data_parallel_size)
        _core.start()  # sets JAXLLM_ENGINE_ADDRESS / JAXLLM_ENGINE_SECRET, inherited by the workers


def on_exit(server):
    if _core is not None:
        _core.stop()
    if _metrics_dir is not None:
        shutil.rmtree(_metrics_dir, ignore_errors=True)


def post_worker_init(worker):
    """In-process engine: if it dies (a device error, a bug in a step), this worker exits once in-flight requests
    got their 503, and gunicorn's arbiter starts a fresh worker: its restart is the recovery mechanism. (With an
    engine-core process the worker stays up, answers 503 and reconnects when the core is back.)"""
    import signal

    import server.app as app_module
    from jaxllm.engine.engine_loop import EngineLoop

    if app_module._app is not None:
        loop = app_module._app.extensions["jaxllm"].loop
        if isinstance(loop, EngineLoop):
            pid = os.getpid()
            loop.on_death = lambda: os.kill(pid, signal.SIGTERM)


def worker_exit(server, worker):
    """SIGTERM: gunicorn stops accepting and lets in-flight requests finish; then stop the engine (or, with an
    engine core, this worker's requests in it)."""
    import server.app as app_module

    if app_module._app is not None:
        st = app_module._app.extensions["jaxllm"]
        st.loop.stop(drain_timeout_s=st.settings.drain_timeout_s)
