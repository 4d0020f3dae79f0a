"""gunicorn's settings file for ``gunicorn server.app:app`` (read from the working directory). The settings and
hooks live in `server.gunicorn_config`, which ``jaxllm serve`` runs too: one server, two front doors."""

from server.gunicorn_config import *  # noqa: F403
from server.gunicorn_config import on_exit, on_starting, post_worker_init, worker_exit  # noqa: F401
