"""gunicorn settings for ``gunicorn server.app:app``: one gevent worker holding the engine.

One worker: each worker process would load its own model and KV cache. No preload: JAX must not start in
the master before the fork. The engine runs in its own OS thread, so the gevent hub stays free for I/O.
"""

import os

bind = os.environ.get("JAXLLM_BIND", "0.0.0.0:8000")
workers = 1
worker_class = "gevent"
worker_connections = 1000
# Loading the model and compiling every bucket happens before the worker serves; give it time.
timeout = int(os.environ.get("JAXLLM_WORKER_TIMEOUT", 600))
graceful_timeout = int(float(os.environ.get("JAXLLM_DRAIN_TIMEOUT", 30))) + 5
keepalive = 5
accesslog = None  # the app logs one line per request with token counts
loglevel = os.environ.get("JAXLLM_LOG_LEVEL", "info")
# TLS: gunicorn terminates it itself when both files are given.
certfile = os.environ.get("JAXLLM_SSL_CERTFILE") or None
keyfile = os.environ.get("JAXLLM_SSL_KEYFILE") or None


def post_worker_init(worker):
    """If the engine dies (a device error, a bug in a step), this worker exits once in-flight requests got
    their 503, and gunicorn's arbiter starts a fresh worker: its restart is the recovery mechanism."""
    import signal

    import server.app as app_module

    if app_module._app is not None:
        pid = os.getpid()
        app_module._app.extensions["jaxllm"].loop.on_death = lambda: os.kill(pid, signal.SIGTERM)


def worker_exit(server, worker):
    """SIGTERM: gunicorn stops accepting and lets in-flight requests finish; then stop the engine."""
    import server.app as app_module

    if app_module._app is not None:
        st = app_module._app.extensions["jaxllm"]
        st.loop.stop(drain_timeout_s=st.settings.drain_timeout_s)
