"""Hands engine outputs from the engine's OS thread to the greenlet serving the request, and runs a request's
CPU-heavy preparation (chat template, tokenization) off the hub thread.

Under gevent, a per-request `gevent.queue.Queue` is only ever touched by the hub thread: the engine thread
schedules `put_nowait` on the hub with `loop.run_callback_threadsafe`, which also wakes the hub. Without
gevent (Flask's test client, a threaded server) a C `_queue.SimpleQueue` does the same job.
"""

from __future__ import annotations

import _queue
from collections.abc import Callable
from typing import TypeVar

from jaxllm.engine.engine_loop import gevent_active
from jaxllm.tokenizer.tokenizer import LONG_TEXT_CHARS

T = TypeVar("T")


class OutputStream:
    def __init__(self):
        if gevent_active():
            import gevent.queue
            from gevent import get_hub

            self._loop = get_hub().loop
            self._queue = gevent.queue.Queue()
            self._gevent = True
        else:
            self._queue = _queue.SimpleQueue()
            self._gevent = False

    def push(self, item) -> None:
        """Called on the engine thread."""
        if self._gevent:
            self._loop.run_callback_threadsafe(self._queue.put_nowait, item)
        else:
            self._queue.put(item)

    def get(self, timeout: float | None = None):
        """The next item, or None after `timeout` seconds without one."""
        try:
            return self._queue.get(timeout=timeout)
        except _queue.Empty:  # gevent.queue.Empty is the same class
            return None


OFFLOAD_THREADS = 2
_pool = None


def offload(text_chars: int, fn: Callable[..., T], *args) -> T:
    """Runs fn(*args), whose cost grows with `text_chars` characters of text to template and tokenize. A long
    text runs on a small pool of real OS threads while only this greenlet waits, so one long prompt does not
    stall every other request's I/O (the tokenizer releases the GIL); a short one runs inline, since a hand-off
    costs more than it saves and busy pool threads contend with the hub for the GIL (many at once, measured:
    /health 130-220 ms when 64 short requests arrived together). Without gevent, calls fn directly."""
    global _pool
    if text_chars < LONG_TEXT_CHARS or not gevent_active():
        return fn(*args)
    from gevent.threadpool import ThreadPool

    if _pool is None:  # made in the worker process, on its hub
        _pool = ThreadPool(OFFLOAD_THREADS)

    def run():  # exceptions come back as values: gevent would print every refused prompt's traceback
        try:
            return True, fn(*args)
        except Exception as e:
            return False, e

    ok, value = _pool.apply(run)
    if not ok:
        raise value
    return value
