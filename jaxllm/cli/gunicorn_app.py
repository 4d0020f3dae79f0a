"""gunicorn run from Python (`BaseApplication`) with the settings and hooks of `server.gunicorn_config`: what
``jaxllm serve`` starts, the same server as ``gunicorn server.app:app``."""

from __future__ import annotations

from gunicorn.app.base import BaseApplication


class ServeApplication(BaseApplication):
    def load_config(self) -> None:
        import server.gunicorn_config as conf  # reads the environment `jaxllm serve` has set up

        for name in dir(conf):
            if name in self.cfg.settings and getattr(conf, name) is not None:
                self.cfg.set(name, getattr(conf, name))

    def load(self):
        """In each worker, after the fork (the master never builds the app, nor starts JAX)."""
        import server.app

        return server.app.app
