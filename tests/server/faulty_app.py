"""``gunicorn tests.server.faulty_app:app``: the real server app, with one test hook standing in for a device
failure. A step that holds a prompt starting with DEVICE_FAILURE raises inside the engine's model runner, as a
lost accelerator would; everything else is the production code path (engine death -> 503s -> worker exit ->
gunicorn starts a fresh worker)."""

from __future__ import annotations

DEVICE_FAILURE = [7, 7, 7, 7, 3, 1, 4, 1, 5]  # a token-id prompt no test sends by chance
_app = None


def __getattr__(name: str):
    """Built on first access, in the gunicorn worker (importing DEVICE_FAILURE builds nothing)."""
    global _app
    if name != "app":
        raise AttributeError(name)
    if _app is None:
        import server.app

        _app = server.app.app
        runner = _app.extensions["jaxllm"].loop.engine.runner  # the in-process engine (`EngineLoop.engine`)
        dispatch = runner.dispatch

        def failing_dispatch(step, bucket=None, after=None):
            if any(seq.token_ids[:len(DEVICE_FAILURE)] == DEVICE_FAILURE for seq in step.seqs):
                raise RuntimeError("injected device failure")
            return dispatch(step, bucket, after)

        runner.dispatch = failing_dispatch
    return _app
